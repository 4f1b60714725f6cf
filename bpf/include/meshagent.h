/* meshagent eBPF capture: structs, constants and maps shared by every program.
 *
 * Mirrored by agent/redirect/maps_abi.py (ctypes); tests/unit/redirect/test_maps_abi.py
 * checks that each mirror has the size bcc gives the map's key and leaf.
 * Change a struct here and there together, and bump MA_ABI.
 *
 * Maps are shared by all pods on the node and pinned under MA_PIN_MAPS (a
 * -D flag from agent/redirect/ebpf.py): a restarted agent re-opens them, so the
 * programs still attached keep working. Each pod is a key, never a copy.
 * Byte order: addresses are network order as the kernel hands them over;
 * ports in keys and configs are host order unless named *_be.
 */
#ifndef MESHAGENT_H
#define MESHAGENT_H

#include <uapi/linux/bpf.h>
#include <linux/in.h>

#define MA_ABI 3
#define MA_MAX_PORT_RANGES 16
#define MA_MAX_SUBNETS 16
#define MA_MAX_PODS 4096
#define MA_MAX_CONNS 65536
#define MA_SO_ORIGINAL_DST 80 /* <linux/netfilter_ipv4.h>, level SOL_IP */
#define MA_SOL_IP 0
#define MA_SOCK_STREAM 1
#define MA_AF_INET 2
#define MA_AF_INET6 10

/* pod_config.flags */
#define MA_F_OUTBOUND 1 /* connect4/6 rewrite outbound TCP */
#define MA_F_INBOUND 2  /* sk_lookup steers inbound TCP */
#define MA_F_ACCEL 4    /* sockops records loopback pairs for sk_msg */

#ifndef MA_PIN_MAPS
#error "MA_PIN_MAPS must name the bpffs directory for the shared maps"
#endif

struct ma_port_range {
    __u16 first;
    __u16 last;
};

struct ma_subnet4 {
    __u32 addr; /* network order, host bits zero */
    __u32 mask; /* network order */
};

/* One pod's capture settings, filled by the agent from its CaptureSpec. */
struct ma_pod_config {
    __u32 pod_ip;        /* network order */
    __u32 mark;          /* sockets carrying it are the proxy's: never captured */
    __u16 outbound_port; /* listener in the pod netns, on 127.0.0.1 */
    __u16 inbound_port;  /* informational: sk_lookup uses the listener map */
    __u16 flags;         /* MA_F_* */
    __u16 n_skip_out;
    __u16 n_skip_in;
    __u16 n_subnets;
    __u32 accel_max_msg; /* sk_msg redirects messages up to this size; 0: none */
    struct ma_port_range skip_out[MA_MAX_PORT_RANGES];
    struct ma_port_range skip_in[MA_MAX_PORT_RANGES]; /* proxy ports included */
    struct ma_subnet4 subnets[MA_MAX_SUBNETS];
    __u16 n_skip_accel;
    __u16 _pad;
    /* with MA_F_ACCEL: connections to these ports (the app's original destination
     * port, or the app port the proxy dials) stay on the TCP path */
    struct ma_port_range skip_accel[MA_MAX_PORT_RANGES];
};

/* Where a redirected connection was going. */
struct ma_orig_dst {
    __u32 ip;      /* network order */
    __u16 port_be; /* network order, as sockaddr_in wants it */
    __u16 family;  /* AF_INET or AF_INET6 (a v4-mapped destination) */
};

/* A client socket of a redirected connection, as the proxy sees its peer. */
struct ma_conn_key {
    __u64 netns; /* netns cookie */
    __u32 ip;    /* client address, network order */
    __u32 port;  /* client port, host order (u32 keeps the key free of padding) */
};

/* One end of a loopback TCP connection, for sk_msg redirects. */
struct ma_sock_key {
    __u64 netns;
    __u32 local_ip;
    __u32 remote_ip;
    __u32 local_port;  /* host order */
    __u32 remote_port; /* host order */
};

/* --- maps: each .c file declares the ones it uses -------------------------- */

/* bcc's generic table has no sockhash methods, so sockhashes get their own
 * declaration with the methods bcc's frontend rewrites into helper calls.
 * The leaf is a u64 so that a userspace lookup returns the socket cookie. */
#define MA_PINNED_SOCKHASH(_name, _key_type, _max_entries, _pinned)           \
    struct _name##_table_t {                                                  \
        _key_type key;                                                        \
        __u64 leaf;                                                           \
        __u64 *(*lookup)(_key_type *);                                        \
        int (*delete)(_key_type *);                                           \
        int (*sock_hash_update)(void *, void *, u64);                         \
        int (*msg_redirect_hash)(void *, void *, u64);                        \
        u32 max_entries;                                                      \
        int flags;                                                            \
    };                                                                        \
    __attribute__((section("maps/sockhash:" _pinned))) struct _name##_table_t \
        _name = {.max_entries = (_max_entries)};                              \
    BPF_ANNOTATE_KV_PAIR(_name, _key_type, __u64)

/* netns cookie -> pod config. Written by the agent (enroll/unenroll);
 * read by connect4, connect6, sockops, sk_msg. */
#define MA_MAP_CFG_BY_NETNS \
    BPF_TABLE_PINNED("hash", __u64, struct ma_pod_config, ma_cfg_netns, MA_MAX_PODS, \
                     MA_PIN_MAPS "/ma_cfg_netns")

/* pod IPv4 (network order) -> pod config. Written by the agent; read by
 * sk_lookup (which has no netns cookie helper, so it keys by local address). */
#define MA_MAP_CFG_BY_IP \
    BPF_TABLE_PINNED("hash", __u32, struct ma_pod_config, ma_cfg_ip, MA_MAX_PODS, \
                     MA_PIN_MAPS "/ma_cfg_ip")

/* socket cookie -> original destination. Written by connect4/connect6 when
 * they rewrite; read and deleted by sockops at TCP_CONNECT_CB, once the
 * client port is known. LRU: a connect that fails early leaves nothing behind. */
#define MA_MAP_PENDING \
    BPF_TABLE_PINNED("lru_hash", __u64, struct ma_orig_dst, ma_pending, MA_MAX_CONNS, \
                     MA_PIN_MAPS "/ma_pending")

/* (netns, client ip, client port) -> original destination. Written by sockops;
 * read by the getsockopt program (SO_ORIGINAL_DST) and by the agent
 * (agent/redirect/ebpf_origdst.py, inspect). LRU; a port reuse overwrites. */
#define MA_MAP_ORIG_DST \
    BPF_TABLE_PINNED("lru_hash", struct ma_conn_key, struct ma_orig_dst, ma_orig_dst, \
                     MA_MAX_CONNS, MA_PIN_MAPS "/ma_orig_dst")

/* pod IPv4 -> the pod's inbound listener socket. Written by the agent
 * (EbpfRedirector.set_inbound_listener); read by sk_lookup. An entry goes away
 * when its socket closes. */
#define MA_MAP_LISTENERS \
    MA_PINNED_SOCKHASH(ma_listeners, __u32, MA_MAX_PODS, MA_PIN_MAPS "/ma_listeners")

/* loopback socket ends -> socket. Written by sockops (opt-in acceleration);
 * read by sk_msg, which is attached to this map. */
#define MA_MAP_ACCEL_SOCKS \
    MA_PINNED_SOCKHASH(ma_accel_socks, struct ma_sock_key, MA_MAX_CONNS, \
                       MA_PIN_MAPS "/ma_accel_socks")

/* socket end -> MA_ACCEL_*. sockops marks recorded active ends, so that
 * their passive peers join (sockops cannot release a socket looked up in
 * ma_accel_socks); sk_msg marks ends that sent one message too big to
 * redirect: from then on all their data takes the TCP path. The agent marks
 * the peer of a switched-off end it takes out of ma_accel_socks. LRU; sockops
 * deletes an end's entry when its connection reaches TCP_CLOSE. */
#define MA_ACCEL_ACTIVE 1
#define MA_ACCEL_OFF 2
#define MA_MAP_ACCEL_STATE \
    BPF_TABLE_PINNED("lru_hash", struct ma_sock_key, __u32, ma_accel_state, MA_MAX_CONNS, \
                     MA_PIN_MAPS "/ma_accel_state")

/* socket end -> 1: the end redirected at least one message into its peer's
 * receive queue. Written by sk_msg before each redirect (an end it cannot
 * record is switched off instead); deleted by sockops when the connection
 * reaches TCP_CLOSE; read by the agent, which takes a switched-off end out of
 * ma_accel_socks only when its queue of redirected bytes is empty (taking a
 * socket out of the sockhash frees that queue): its peer has no record here,
 * or FIONREAD on the socket says so (agent/redirect/accel_sweep.py). A plain
 * hash, not LRU: an evicted record would let the agent drop bytes. */
#define MA_MAP_ACCEL_SENT \
    BPF_TABLE_PINNED("hash", struct ma_sock_key, __u32, ma_accel_sent, MA_MAX_CONNS, \
                     MA_PIN_MAPS "/ma_accel_sent")

/* --- paired relay (opt-in acceleration; agent/proxy/pairing.py) --------------
 * A worker relaying an opaque TCP connection between two accelerated app ends on
 * this node (app A -> its outbound listener; the worker's socket in B's netns ->
 * app B) pairs each app end with the worker's socket on the other leg. Once
 * every byte an app end sent has been read by the worker and written on
 * (`consumed` == `passed`), sk_msg sends that end's further messages out of the
 * other leg's socket itself (its egress: after all the worker wrote there, and
 * with TCP's backpressure), and the worker leaves the data path of that
 * direction. A direct end whose target socket is gone goes back to the worker
 * for good (MA_PAIR_BROKEN): what it sent directly is already in the target's
 * send queue, so the worker's later writes follow it. */
#define MA_PAIR_WORKER 0 /* through the worker */
#define MA_PAIR_DIRECT 1 /* straight to the target's egress */
#define MA_PAIR_BROKEN 2 /* target gone: through the worker again, for good */

/* `owner` is the entry's own key: sk_msg, finding another there (the worker
 * deleted the entry and it was reused while sk_msg held it), ignores the entry. */
struct ma_pair_ctl {
    struct ma_sock_key owner;
    struct ma_sock_key target; /* the worker's socket on the other leg */
    __u64 consumed;            /* bytes of this end the worker read and wrote on */
};

struct ma_pair_state {
    struct ma_sock_key target; /* copied from ma_pair_ctl when the end went direct */
    __u64 passed;              /* bytes this end sent towards the worker */
    __u64 moved;               /* bytes sk_msg sent straight to the target */
    __u32 mode;                /* MA_PAIR_* */
    __u32 _pad;
};

/* Whether two socket-end keys are equal. */
static __always_inline int ma_sock_key_eq(const struct ma_sock_key *a, const struct ma_sock_key *b)
{
    return a->netns == b->netns && a->local_ip == b->local_ip && a->remote_ip == b->remote_ip &&
           a->local_port == b->local_port && a->remote_port == b->remote_port;
}

/* app end -> what the worker asks. Written and deleted by the worker; sockops
 * deletes an app end's entry when it records the end, so a connection that
 * reuses a closed one's addresses never inherits its pairing. LRU: an entry a
 * dead worker left goes in time, and an evicted one only unpairs its end. */
#define MA_MAP_PAIR_CTL \
    BPF_TABLE_PINNED("lru_hash", struct ma_sock_key, struct ma_pair_ctl, ma_pair_ctl, \
                     MA_MAX_CONNS, MA_PIN_MAPS "/ma_pair_ctl")

/* app end -> its byte counts and mode. Created by sockops when it records an app
 * end and deleted by sockops when the end reaches TCP_CLOSE, both under the
 * socket's lock as sk_msg runs, so sk_msg never holds an entry that is deleted
 * or reused meanwhile; read by the worker (bytes moved past it: metrics, idle).
 * A plain hash: eviction would reuse an entry under sk_msg. Full, it leaves new
 * app ends unpaired. */
#define MA_MAP_PAIR_STATE \
    BPF_TABLE_PINNED("hash", struct ma_sock_key, struct ma_pair_state, ma_pair_state, \
                     MA_MAX_CONNS, MA_PIN_MAPS "/ma_pair_state")

/* app end -> the bytes it moved past the worker, filed by sockops when a paired
 * end reaches TCP_CLOSE before its worker read them (its ma_pair_ctl entry is
 * still there: an app that closes first). Read and deleted by the worker; sockops
 * deletes a fresh app end's. LRU: counts only. */
#define MA_MAP_PAIR_MOVED \
    BPF_TABLE_PINNED("lru_hash", struct ma_sock_key, __u64, ma_pair_moved, MA_MAX_CONNS, \
                     MA_PIN_MAPS "/ma_pair_moved")

#define ma_barrier() asm volatile("" ::: "memory")

/* --- helpers ----------------------------------------------------------------- */

static __always_inline int ma_is_loopback(__u32 ip_be)
{
    return (bpf_ntohl(ip_be) >> 24) == 127;
}

static __always_inline int ma_port_in(const struct ma_port_range *r, __u16 n, __u16 port)
{
    for (int i = 0; i < MA_MAX_PORT_RANGES; i++) {
        if (i >= n)
            break;
        if (port >= r[i].first && port <= r[i].last)
            return 1;
    }
    return 0;
}

static __always_inline int ma_subnet_in(const struct ma_pod_config *cfg, __u32 ip_be)
{
    for (int i = 0; i < MA_MAX_SUBNETS; i++) {
        if (i >= cfg->n_subnets)
            break;
        if ((ip_be & cfg->subnets[i].mask) == cfg->subnets[i].addr)
            return 1;
    }
    return 0;
}

/* Whether a TCP connect from a pod to ip:port goes to the outbound listener
 * (the iptables plan's PROXY_INIT_OUTPUT, in BPF). */
static __always_inline int ma_should_redirect(const struct ma_pod_config *cfg, __u32 ip_be,
                                              __u16 port, __u32 sock_mark)
{
    if (!(cfg->flags & MA_F_OUTBOUND))
        return 0;
    if (sock_mark == cfg->mark)
        return 0; /* the proxy's own socket */
    if (ip_be == 0 || ma_is_loopback(ip_be) || ip_be == cfg->pod_ip)
        return 0; /* what `-o lo` skips in iptables mode */
    if (ma_port_in(cfg->skip_out, cfg->n_skip_out, port))
        return 0;
    if (ma_subnet_in(cfg, ip_be))
        return 0;
    return 1;
}

/* MA_DEFINE_IP4_OF(name, ctx_type) defines `int name(ctx_type *c, __u32 *local,
 * __u32 *remote)`: the IPv4 addresses of an AF_INET socket, or of an AF_INET6 one
 * whose addresses are v4-mapped (a dual-stack [::] listener's connections, e.g.
 * iperf3's); 0 for anything else. `struct bpf_sock_ops` (sockops) and `struct
 * sk_msg_md` (sk_msg) name these fields alike; a macro gives each program a
 * function typed for its own context.
 * Every field is read up front, each at its own constant offset: a load whose
 * address depends on the family is a "modified ctx ptr" to the verifier. The
 * empty asm uses each value, so clang cannot sink the loads into the branches
 * and merge them into one load from a chosen offset. */
#define MA_DEFINE_IP4_OF(name, ctx_type)                                                    \
    static __always_inline int name(ctx_type *c, __u32 *local, __u32 *remote)             \
    {                                                                                      \
        __u32 family = c->family;                                                          \
        __u32 l4 = c->local_ip4, r4 = c->remote_ip4;                                       \
        __u32 l6_0 = c->local_ip6[0], l6_1 = c->local_ip6[1];                              \
        __u32 l6_2 = c->local_ip6[2], l6_3 = c->local_ip6[3];                              \
        __u32 r6_0 = c->remote_ip6[0], r6_1 = c->remote_ip6[1];                            \
        __u32 r6_2 = c->remote_ip6[2], r6_3 = c->remote_ip6[3];                            \
        asm volatile("" : : "r"(l4), "r"(r4), "r"(l6_3), "r"(r6_3));                       \
        asm volatile("" : : "r"(l6_0), "r"(l6_1), "r"(l6_2), "r"(r6_0), "r"(r6_1), "r"(r6_2)); \
        if (family == MA_AF_INET) {                                                        \
            *local = l4;                                                                   \
            *remote = r4;                                                                  \
            return 1;                                                                      \
        }                                                                                  \
        if (family != MA_AF_INET6 || (l6_0 | l6_1 | r6_0 | r6_1))                          \
            return 0;                                                                      \
        if (l6_2 != bpf_htonl(0xffff) || r6_2 != bpf_htonl(0xffff))                        \
            return 0;                                                                      \
        *local = l6_3;                                                                     \
        *remote = r6_3;                                                                    \
        return 1;                                                                          \
    }

/* MA_DEFINE_SOCK_KEY_OF(name, ip4_of, ctx_type) defines `int name(ctx_type *c, struct
 * ma_sock_key *k)`: the key of this socket end (its netns, IPv4 addresses by `ip4_of`,
 * ports in host order), or 0 for a socket that is not IPv4 (or v4-mapped). */
#define MA_DEFINE_SOCK_KEY_OF(name, ip4_of, ctx_type)                                       \
    static __always_inline int name(ctx_type *c, struct ma_sock_key *k)                   \
    {                                                                                      \
        __u32 local = 0, remote = 0;                                                       \
        if (!ip4_of(c, &local, &remote))                                                   \
            return 0;                                                                      \
        k->netns = bpf_get_netns_cookie(c);                                                \
        k->local_ip = local;                                                               \
        k->remote_ip = remote;                                                             \
        k->local_port = c->local_port;                                                     \
        k->remote_port = bpf_ntohl(c->remote_port);                                        \
        return 1;                                                                          \
    }

#endif /* MESHAGENT_H */
