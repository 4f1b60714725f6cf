/* cgroup/connect6 on a pod's cgroup: the same rewrite as connect4 for IPv6
 * sockets connecting to a v4-mapped address (::ffff:a.b.c.d), which is how
 * dual-stack runtimes reach IPv4 services and which connect4 never sees. The
 * destination becomes ::ffff:127.0.0.1:outbound_port, so the client still
 * appears to the IPv4 listener as 127.0.0.1:port.
 *
 * Native IPv6 destinations pass through untouched: the outbound listener and
 * SO_ORIGINAL_DST are IPv4 only.
 */
#include "include/meshagent.h"

MA_MAP_CFG_BY_NETNS;
MA_MAP_PENDING;

int ma_connect6(struct bpf_sock_addr *ctx)
{
    if (ctx->type != MA_SOCK_STREAM)
        return 1;
    if (ctx->user_ip6[0] != 0 || ctx->user_ip6[1] != 0 ||
        ctx->user_ip6[2] != bpf_htonl(0x0000ffff))
        return 1;
    __u64 netns = bpf_get_netns_cookie(ctx);
    struct ma_pod_config *cfg = ma_cfg_netns.lookup(&netns);
    if (!cfg)
        return 1;
    __u32 mark = 0;
    struct bpf_sock *sk = ctx->sk;
    if (sk)
        mark = sk->mark;
    __u32 ip = ctx->user_ip6[3];
    __u16 port_be = (__u16)ctx->user_port;
    if (!ma_should_redirect(cfg, ip, bpf_ntohs(port_be), mark))
        return 1;
    __u64 cookie = bpf_get_socket_cookie(ctx);
    struct ma_orig_dst dst = {.ip = ip, .port_be = port_be, .family = MA_AF_INET6};
    ma_pending.update(&cookie, &dst);
    ctx->user_ip6[3] = bpf_htonl(0x7f000001);
    ctx->user_port = bpf_htons(cfg->outbound_port);
    return 1;
}
