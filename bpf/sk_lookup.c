/* sk_lookup on a pod's network namespace: inbound TCP to the pod's address
 * goes to the pod's inbound listener, whatever port it was sent to, except
 * skipped ports (skip-inbound-ports and the proxy's own ports) and sources in
 * skip-subnets. The accepted socket's local address is the original
 * destination. Loopback traffic (the proxy forwarding to the app) is never
 * steered.
 *
 * sk_lookup has no netns cookie helper, so a pod is found by its address.
 * A meshed pod whose listener is not (yet) in the map gets its inbound
 * connections refused rather than delivered around the proxy: fail closed.
 */
#include "include/meshagent.h"

MA_MAP_CFG_BY_IP;
MA_MAP_LISTENERS;

int ma_sk_lookup(struct bpf_sk_lookup *ctx)
{
    if (ctx->protocol != IPPROTO_TCP || ctx->family != MA_AF_INET)
        return SK_PASS;
    __u32 ip = ctx->local_ip4;
    if (ma_is_loopback(ip))
        return SK_PASS;
    struct ma_pod_config *cfg = ma_cfg_ip.lookup(&ip);
    if (!cfg || !(cfg->flags & MA_F_INBOUND))
        return SK_PASS;
    if (ma_port_in(cfg->skip_in, cfg->n_skip_in, (__u16)ctx->local_port))
        return SK_PASS;
    if (ma_subnet_in(cfg, ctx->remote_ip4))
        return SK_PASS;
    struct bpf_sock *sk = (struct bpf_sock *)ma_listeners.lookup(&ip);
    if (!sk)
        return SK_DROP;
    long err = bpf_sk_assign(ctx, sk, 0);
    bpf_sk_release(sk);
    return err ? SK_DROP : SK_PASS;
}
