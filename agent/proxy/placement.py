"""Which worker takes a new connection: the one of the CPU the connection was made on.
Pure: the shells are `agent.proxy.listener` (`attach_steering`), `agent.proxy.pool`
and `agent.proxy.worker` (`--cpu`).

Rules:
1. `slot_cpus`: slot i belongs to the i-th of the node's allowed CPUs in ascending
   order, round robin when there are more slots than CPUs. A replaced worker keeps
   its slot's CPU.
2. `steering_program`: a classic BPF program for a listener's SO_REUSEPORT group
   (`SO_ATTACH_REUSEPORT_CBPF`, one per group, agent.proxy.listener rule 2). It loads
   the number of the CPU the kernel takes the SYN in on and returns that CPU's slot,
   so the connection is accepted by that worker. On loopback and veth, the pod paths
   here, that CPU is the connecting thread's; from a NIC it is the receive queue's. A
   CPU without a slot returns an index past the group, and the kernel then picks by
   the addresses' hash, as with no program.
3. No steering (None) when a CPU has two slots: steering would send all of that CPU's
   connections to one of them and leave the other idle. So steering needs at most as
   many workers as CPUs, and at most `MAX_STEERED_CPUS` of them (the program's length
   limit).
4. `meshagent run --cpu-placement`: `off` (the default) leaves the kernel's hash;
   `steer` steers and lets the kernel run each worker where it likes; `pin` also pins
   worker i to its CPU. Measured on the bench's 2-vCPU machine (bench/RESULTS.md,
   forty-first pass), where a round trip between two processes takes 4.5 us on one
   CPU and 66 us across two (waking an idle vCPU goes through the host): steering
   keeps a client's connections on one worker, which stays busy where two would each
   be woken from idle (conn-rate +27%, http1-saturate +9%), but a one-process
   client's bursts then queue on that one worker (p99 at saturation 1.7x). Pinning
   cut CPU per request at 500-2,000 requests/s by a further third, but such a client
   then shares its CPU with its one worker (conn-rate -39%). Neither is the default
   while the tail latency goal is the tighter one. `bind` pins worker i to its CPU
   and leaves connections to the kernel's hash (no program): in 3 paired rounds
   (forty-third pass) saturation +3% and its p99 -27%, conn-rate +4%, p50 at 1,000
   and 2,000 requests/s -3 to -6%, but the side-by-side added p99 moved within its
   noise both ways; opt-in too, until the tail says more.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence

# Classic BPF (linux/filter.h, linux/bpf_common.h).
_LD_W_ABS: Final = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K: Final = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K: Final = 0x06  # BPF_RET | BPF_K
_SKF_AD_CPU: Final = 0xFFFFF000 + 36  # SKF_AD_OFF + SKF_AD_CPU: "the current CPU"
NO_SLOT: Final = 0xFFFFFFFF  # past any group: the kernel falls back to the hash
_MAX_INSNS: Final = 4096  # BPF_MAXINSNS
MAX_STEERED_CPUS: Final = (_MAX_INSNS - 2) // 2  # a load, 2 per CPU, the default return
INSN: Final = struct.Struct("=HBBI")  # struct sock_filter: code, jt, jf, k


def slot_cpus(allowed: Collection[int], workers: int) -> tuple[int, ...]:
    """The CPU of each of `workers` slots (rule 1).

    Raises:
        ValueError: no CPUs or no workers.
    """
    if not allowed or workers < 1:
        raise ValueError(f"cannot place {workers} workers on CPUs {sorted(allowed)}")
    ordered = sorted(allowed)
    return tuple(ordered[i % len(ordered)] for i in range(workers))


def steering_table(cpus: Sequence[int]) -> dict[int, int] | None:
    """CPU -> the slot pinned there, for `slot_cpus`' answer; None when steering would
    not spread (rule 3)."""
    if not cpus or len(set(cpus)) != len(cpus) or len(cpus) > MAX_STEERED_CPUS:
        return None
    return {cpu: slot for slot, cpu in enumerate(cpus)}


def steering_program(table: Mapping[int, int]) -> bytes:
    """The instructions of rule 2's program for `table` (CPU -> slot), packed as the
    kernel's `struct sock_filter` array.

    Raises:
        ValueError: an empty table, or more CPUs than one program can hold.
    """
    if not table or len(table) > MAX_STEERED_CPUS:
        raise ValueError(f"a steering program covers 1 to {MAX_STEERED_CPUS} CPUs")
    insns = [INSN.pack(_LD_W_ABS, 0, 0, _SKF_AD_CPU)]
    for cpu, slot in sorted(table.items()):
        insns.append(INSN.pack(_JEQ_K, 0, 1, cpu))  # equal: the next one; else skip it
        insns.append(INSN.pack(_RET_K, 0, 0, slot))
    insns.append(INSN.pack(_RET_K, 0, 0, NO_SLOT))
    return b"".join(insns)


def decode(program: bytes) -> list[tuple[int, int, int, int]]:
    """`steering_program`'s bytes back as (code, jt, jf, k) tuples."""
    return [INSN.unpack_from(program, off) for off in range(0, len(program), INSN.size)]


def run(program: bytes, cpu: int) -> int:
    """What the kernel gets back from `program` on `cpu`: a slot, or `NO_SLOT`. An
    interpreter of the three instructions `steering_program` uses, for tests.

    Raises:
        ValueError: an instruction it does not know, or no return.
    """
    insns = decode(program)
    acc, pc = 0, 0
    while pc < len(insns):
        code, jt, jf, k = insns[pc]
        if code == _LD_W_ABS and k == _SKF_AD_CPU:
            acc, pc = cpu, pc + 1
        elif code == _JEQ_K:
            pc += 1 + (jt if acc == k else jf)
        elif code == _RET_K:
            return k
        else:
            raise ValueError(f"instruction {pc}: code {code:#x} is not a steering one")
    raise ValueError("the program ends without a return")
