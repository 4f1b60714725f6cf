/* sk_msg on ma_accel_socks (opt-in acceleration): a message sent on a
 * recorded loopback socket goes straight into its peer's receive queue,
 * skipping the TCP stack.
 *
 * Bulk writes through redirects failed with ENOMEM (DESIGN.md, kernel notes),
 * so only messages up to the pod's accel_max_msg are redirected. The first
 * larger one switches that socket end to the TCP path for good: the reader
 * drains redirected bytes before TCP bytes, so one switch keeps the order,
 * switching back could not. A redirect that finds no peer passes to TCP.
 */
#include "include/meshagent.h"

MA_MAP_CFG_BY_NETNS;
MA_MAP_ACCEL_SOCKS;
MA_MAP_ACCEL_STATE;

int ma_sk_msg(struct sk_msg_md *msg)
{
    if (msg->family != MA_AF_INET)
        return SK_PASS;
    struct ma_sock_key self = {};
    self.netns = bpf_get_netns_cookie(msg);
    self.local_ip = msg->local_ip4;
    self.remote_ip = msg->remote_ip4;
    self.local_port = msg->local_port;
    self.remote_port = bpf_ntohl(msg->remote_port);
    __u32 *state = ma_accel_state.lookup(&self);
    if (state && *state == MA_ACCEL_OFF)
        return SK_PASS;
    struct ma_pod_config *cfg = ma_cfg_netns.lookup(&self.netns);
    if (!cfg || !(cfg->flags & MA_F_ACCEL) || msg->size > cfg->accel_max_msg) {
        __u32 off = MA_ACCEL_OFF;
        ma_accel_state.update(&self, &off);
        return SK_PASS;
    }
    struct ma_sock_key peer = {};
    peer.netns = self.netns;
    peer.local_ip = self.remote_ip;
    peer.remote_ip = self.local_ip;
    peer.local_port = self.remote_port;
    peer.remote_port = self.local_port;
    ma_accel_socks.msg_redirect_hash(msg, &peer, BPF_F_INGRESS);
    return SK_PASS;
}
