/* cgroup/getsockopt on the agent's cgroup: answers getsockopt(SOL_IP,
 * SO_ORIGINAL_DST) on a connection accepted from an outbound listener, from
 * the map sockops fills. So the proxy has one way to ask in both modes.
 *
 * It runs after the kernel's own handler. A map entry wins (in a pod netns
 * where conntrack is active, conntrack would answer 127.0.0.1:outbound_port);
 * otherwise the kernel's answer (iptables mode) stands untouched.
 * The hook runs for the socket's cgroup: an accepted socket inherits its
 * listener's, and the agent creates the listeners.
 */
#include "include/meshagent.h"

MA_MAP_ORIG_DST;

struct ma_sockaddr_in {
    __u16 family;
    __u16 port_be;
    __u32 addr;
    __u8 zero[8];
};

int ma_getsockopt(struct bpf_sockopt *ctx)
{
    if (ctx->level != MA_SOL_IP || ctx->optname != MA_SO_ORIGINAL_DST)
        return 1;
    struct bpf_sock *sk = ctx->sk;
    if (!sk)
        return 1;
    struct ma_conn_key key = {};
    key.netns = bpf_get_netns_cookie(ctx);
    key.ip = sk->dst_ip4;
    key.port = bpf_ntohs((__u16)sk->dst_port);
    struct ma_orig_dst *dst = ma_orig_dst.lookup(&key);
    if (!dst)
        return 1;
    struct ma_sockaddr_in *out = ctx->optval;
    if ((void *)(out + 1) > ctx->optval_end)
        return 1; /* the caller's buffer is too small: leave the kernel's answer */
    out->family = MA_AF_INET;
    out->port_be = dst->port_be;
    out->addr = dst->ip;
    __builtin_memset(out->zero, 0, sizeof(out->zero));
    /* two 4-byte stores: clang would merge them into one 8-byte store the
     * verifier rejects as a context access */
    volatile __s32 *optlen = &ctx->optlen;
    *optlen = sizeof(*out);
    ctx->retval = 0;
    return 1;
}
