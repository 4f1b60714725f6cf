/* sk_lookup on a pod's network namespace: inbound TCP to the pod's address
 * goes to the pod's inbound listener, whatever port it was sent to, except
 * skipped ports (skip-inbound-ports and the proxy's own ports) and sources in
 * skip-subnets. The accepted socket's local address is the original
 * destination. Loopback destinations are never steered.
 *
 * Connections from the pod to its own address (remote == local) are never
 * steered either. The proxy's inbound forwarding is one: it dials B's app at
 * B's pod IP from inside B's netns, and sk_lookup cannot see its socket mark
 * (the lookup runs on the SYN, before any socket of ours is at hand), so
 * without this rule that connection would loop back into the 4143 listener.
 * The app dialling its own pod IP is the other, and it is left alone on
 * purpose: that is what Linkerd's iptables does (traffic leaving via `lo`
 * RETURNs in the output chain, and locally generated packets never reach
 * the prerouting chain), what our iptables plan does, and connect4 likewise
 * skips the pod's own address, so both modes agree that a pod talking to
 * itself is not meshed. A peer cannot forge remote == local from outside:
 * the kernel drops packets from the wire whose source is a local address
 * (martian source; net.ipv4.conf.*.accept_local is 0 by default).
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
    if (ctx->remote_ip4 == ip) /* the pod to itself: see the header */
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
