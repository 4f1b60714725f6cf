/* sockops on pod cgroups (and, with acceleration, on the agent's cgroup).
 *
 * 1. TCP_CONNECT_CB: a socket connect4/connect6 rewrote now has its client
 *    port; its original destination moves from the cookie-keyed pending map
 *    to (netns, client ip, client port), the key the proxy can compute from
 *    the socket it accepts.
 * 2. Opt-in (MA_F_ACCEL): established sockets of a pod's proxy connections
 *    that stay inside the pod's netns go into ma_accel_socks, where sk_msg
 *    finds the peer: active ends connecting to the outbound listener or
 *    carrying the proxy mark, and passive ends whose active peer was recorded.
 *    "Inside the netns" is a loopback pair (app -> 127.0.0.1:4140) or a
 *    connection from the pod's IP to itself (the proxy forwarding to the
 *    app at the pod IP, agent/proxy/inbound.py app_addr): both go over lo.
 *    A passive end drops a stale MA_ACCEL_OFF a closed connection with the
 *    same addresses left in ma_accel_state. An active end whose port is in
 *    the pod's skip_accel is not recorded (nor so its peer): the app's
 *    original destination port for app -> 127.0.0.1:4140 (from ma_orig_dst,
 *    filed at TCP_CONNECT_CB, before the handshake ends), the port dialled for
 *    the proxy's connection to the app.
 * 3. A recorded end asks for state callbacks; at TCP_CLOSE its entries in
 *    ma_accel_state, ma_accel_sent and ma_pair_state go (what a paired end moved
 *    is filed in ma_pair_moved while its worker, whose ma_pair_ctl entry is still
 *    there, has yet to read it).
 * 4. A recorded app end (not the proxy's: the app's connection to the outbound
 *    listener, the app's side of a marked proxy connection) gets a zeroed
 *    ma_pair_state, and no ma_pair_ctl or ma_pair_moved, before its first
 *    message, for sk_msg's paired relay (meshagent.h).
 */
#include "include/meshagent.h"

MA_MAP_CFG_BY_NETNS;
MA_MAP_PENDING;
MA_MAP_ORIG_DST;
MA_MAP_ACCEL_SOCKS;
MA_MAP_ACCEL_STATE;
MA_MAP_ACCEL_SENT;
MA_MAP_PAIR_CTL;
MA_MAP_PAIR_STATE;
MA_MAP_PAIR_MOVED;

static __always_inline void ma_move_orig_dst(struct bpf_sock_ops *skops)
{
    __u64 cookie = bpf_get_socket_cookie(skops);
    struct ma_orig_dst *dst = ma_pending.lookup(&cookie);
    if (!dst)
        return;
    struct ma_conn_key key = {};
    key.netns = bpf_get_netns_cookie(skops);
    key.ip = skops->local_ip4;
    key.port = skops->local_port;
    struct ma_orig_dst copy = *dst;
    ma_orig_dst.update(&key, &copy);
    ma_pending.delete(&cookie);
}

/* Both ends in this netns, talking over lo. */
static __always_inline int ma_accel_local_pair(__u32 local_be, __u32 remote_be)
{
    if (ma_is_loopback(local_be) && ma_is_loopback(remote_be))
        return 1;
    return local_be == remote_be;
}

/* Rule 2: whether an active end's connection is on one of the pod's skip_accel
 * ports. A connection to the outbound listener is judged by where the app was
 * going; one to the listener without an entry (the app dialled 127.0.0.1:4140
 * itself) by the listener's port. */
static __always_inline int ma_accel_skipped(const struct ma_pod_config *cfg,
                                            const struct ma_sock_key *key)
{
    if (cfg->n_skip_accel == 0)
        return 0;
    __u16 port = (__u16)key->remote_port;
    if (key->remote_port == cfg->outbound_port) {
        struct ma_conn_key ck = {};
        ck.netns = key->netns;
        ck.ip = key->local_ip;
        ck.port = key->local_port;
        struct ma_orig_dst *dst = ma_orig_dst.lookup(&ck);
        if (dst)
            port = bpf_ntohs(dst->port_be);
    }
    return ma_port_in(cfg->skip_accel, cfg->n_skip_accel, port);
}

MA_DEFINE_IP4_OF(ma_sockops_ip4, struct bpf_sock_ops)
MA_DEFINE_SOCK_KEY_OF(ma_sockops_key, ma_sockops_ip4, struct bpf_sock_ops)

/* Rule 4: an app end starts its byte count from its first message. */
static __always_inline void ma_pair_open(struct ma_sock_key *key)
{
    struct ma_pair_state st = {};
    ma_pair_state.update(key, &st);
    ma_pair_ctl.delete(key);
    ma_pair_moved.delete(key);
}

static __always_inline void ma_accel_record(struct bpf_sock_ops *skops, int active)
{
    struct ma_sock_key key = {};
    if (!ma_sockops_key(skops, &key))
        return;
    if (!ma_accel_local_pair(key.local_ip, key.remote_ip))
        return;
    __u64 netns = key.netns;
    struct ma_pod_config *cfg = ma_cfg_netns.lookup(&netns);
    if (!cfg || !(cfg->flags & MA_F_ACCEL))
        return;
    if (active) {
        __u32 mark = 0;
        struct bpf_sock *sk = skops->sk;
        if (sk)
            mark = sk->mark;
        if (key.remote_port != cfg->outbound_port && mark != cfg->mark)
            return;
        if (ma_accel_skipped(cfg, &key))
            return;
        __u32 state = MA_ACCEL_ACTIVE;
        ma_accel_state.update(&key, &state);
    } else {
        struct ma_sock_key peer = {};
        peer.netns = netns;
        peer.local_ip = key.remote_ip;
        peer.remote_ip = key.local_ip;
        peer.local_port = key.remote_port;
        peer.remote_port = key.local_port;
        __u32 *state = ma_accel_state.lookup(&peer);
        if (!state || *state != MA_ACCEL_ACTIVE)
            return;
        ma_accel_state.delete(&key);
    }
    int err = ma_accel_socks.sock_hash_update(skops, &key, BPF_ANY);
    if (err != 0)
        return;
    bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
    /* app ends: the app's connection to the outbound listener, the app's side of
     * the proxy's connection to it (a passive end not on the listener's port) */
    int app = active ? key.remote_port == cfg->outbound_port : key.local_port != cfg->outbound_port;
    if (app)
        ma_pair_open(&key);
}

/* Rule 3: only recorded ends asked for the callback. */
static __always_inline void ma_accel_closed(struct bpf_sock_ops *skops)
{
    if (skops->args[1] != BPF_TCP_CLOSE)
        return;
    struct ma_sock_key key = {};
    if (!ma_sockops_key(skops, &key))
        return;
    ma_accel_sent.delete(&key);
    ma_accel_state.delete(&key);
    struct ma_pair_state *ps = ma_pair_state.lookup(&key);
    if (ps && ps->moved && ma_pair_ctl.lookup(&key)) { /* its worker has yet to read it */
        __u64 moved = ps->moved;
        ma_pair_moved.update(&key, &moved);
    }
    ma_pair_state.delete(&key);
}

int ma_sockops(struct bpf_sock_ops *skops)
{
    switch (skops->op) {
    case BPF_SOCK_OPS_TCP_CONNECT_CB:
        ma_move_orig_dst(skops);
        break;
    case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
        ma_accel_record(skops, 1);
        break;
    case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
        ma_accel_record(skops, 0);
        break;
    case BPF_SOCK_OPS_STATE_CB:
        ma_accel_closed(skops);
        break;
    }
    return 1;
}
