/* sockops on pod cgroups (and, with acceleration, on the agent's cgroup).
 *
 * 1. TCP_CONNECT_CB: a socket connect4/connect6 rewrote now has its client
 *    port; its original destination moves from the cookie-keyed pending map
 *    to (netns, client ip, client port), the key the proxy can compute from
 *    the socket it accepts.
 * 2. Opt-in (MA_F_ACCEL): established loopback sockets of a pod's proxy
 *    connections go into ma_accel_socks, where sk_msg finds the peer:
 *    active ends connecting to the outbound listener or carrying the proxy
 *    mark, and passive ends whose active peer was recorded.
 */
#include "include/meshagent.h"

MA_MAP_CFG_BY_NETNS;
MA_MAP_PENDING;
MA_MAP_ORIG_DST;
MA_MAP_ACCEL_SOCKS;
MA_MAP_ACCEL_STATE;

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

static __always_inline void ma_accel_record(struct bpf_sock_ops *skops, int active)
{
    if (skops->family != MA_AF_INET)
        return;
    if (!ma_is_loopback(skops->local_ip4) || !ma_is_loopback(skops->remote_ip4))
        return;
    __u64 netns = bpf_get_netns_cookie(skops);
    struct ma_pod_config *cfg = ma_cfg_netns.lookup(&netns);
    if (!cfg || !(cfg->flags & MA_F_ACCEL))
        return;
    struct ma_sock_key key = {};
    key.netns = netns;
    key.local_ip = skops->local_ip4;
    key.remote_ip = skops->remote_ip4;
    key.local_port = skops->local_port;
    key.remote_port = bpf_ntohl(skops->remote_port);
    if (active) {
        __u32 mark = 0;
        struct bpf_sock *sk = skops->sk;
        if (sk)
            mark = sk->mark;
        if (key.remote_port != cfg->outbound_port && mark != cfg->mark)
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
    }
    ma_accel_socks.sock_hash_update(skops, &key, BPF_ANY);
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
    }
    return 1;
}
