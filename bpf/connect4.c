/* cgroup/connect4 on a pod's cgroup: a meshed pod's outbound TCP connect goes
 * to the pod's outbound listener (127.0.0.1:outbound_port in its netns).
 *
 * The original destination is parked under the socket cookie; sockops moves it
 * under (netns, client ip, client port) once the port is chosen, where the
 * getsockopt program and the agent find it. Skipped: pods without config,
 * sockets carrying the proxy mark, loopback and the pod's own address,
 * skip-outbound-ports and skip-subnets (as the iptables plan does).
 */
#include "include/meshagent.h"

MA_MAP_CFG_BY_NETNS;
MA_MAP_PENDING;

int ma_connect4(struct bpf_sock_addr *ctx)
{
    if (ctx->type != MA_SOCK_STREAM)
        return 1;
    __u64 netns = bpf_get_netns_cookie(ctx);
    struct ma_pod_config *cfg = ma_cfg_netns.lookup(&netns);
    if (!cfg)
        return 1;
    __u32 mark = 0;
    struct bpf_sock *sk = ctx->sk;
    if (sk)
        mark = sk->mark;
    __u32 ip = ctx->user_ip4;
    __u16 port_be = (__u16)ctx->user_port;
    if (!ma_should_redirect(cfg, ip, bpf_ntohs(port_be), mark))
        return 1;
    __u64 cookie = bpf_get_socket_cookie(ctx);
    struct ma_orig_dst dst = {.ip = ip, .port_be = port_be, .family = MA_AF_INET};
    ma_pending.update(&cookie, &dst);
    ctx->user_ip4 = bpf_htonl(0x7f000001);
    ctx->user_port = bpf_htons(cfg->outbound_port);
    return 1;
}
