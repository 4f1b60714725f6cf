/* sk_msg on ma_accel_socks (opt-in acceleration): a message sent on a
 * recorded socket end goes straight into its peer's receive queue,
 * skipping the TCP stack.
 *
 * A redirected message lands in the peer's queue at once, whether or not the
 * peer reads: nothing pushes back on the sender as TCP's window does, and a
 * sender that outruns its reader grows that queue until an allocation fails
 * with ENOMEM (DESIGN.md, kernel notes). So a socket end redirects only
 *   - messages up to the pod's accel_max_msg, and
 *   - while the bytes it redirected since its peer last sent stay within
 *     MA_ACCEL_BURST: request/response traffic keeps resetting that count,
 *     a one-way bulk stream crosses it and goes back to TCP;
 *   - while its peer is in ma_accel_socks.
 * The first message that breaks a rule switches that socket end to the TCP
 * path for good (MA_ACCEL_OFF): the reader drains redirected bytes before TCP
 * bytes, so one switch keeps the order, switching back could not. For the
 * same reason a first message that finds no peer switches off too: later
 * redirected ones would overtake it.
 *
 * An app end a worker paired (meshagent.h, "paired relay") sends straight out of
 * the worker's socket on the other leg once the worker has caught up with it;
 * until then, and after its target went, its messages take the usual way.
 *
 * Before its first redirect an end is recorded in ma_accel_sent (an end that
 * cannot be recorded, the map being full, switches off): the agent takes a
 * switched-off end out of the sockhash, back to plain TCP, only when nothing
 * redirected waits in its queue: its peer never redirected into it, or
 * FIONREAD says the queue is empty (agent/redirect/accel_sweep.py).
 */
#include "include/meshagent.h"

#define MA_ACCEL_BURST (256 * 1024)

MA_MAP_CFG_BY_NETNS;
MA_MAP_ACCEL_SOCKS;
MA_MAP_ACCEL_STATE;
MA_MAP_ACCEL_SENT;
MA_MAP_PAIR_CTL;
MA_MAP_PAIR_STATE;

/* socket end -> bytes it redirected since its peer last sent. Written and
 * read by sk_msg only; an end's entry goes when it switches off. LRU. */
BPF_TABLE_PINNED("lru_hash", struct ma_sock_key, __u32, ma_accel_burst, MA_MAX_CONNS,
                 MA_PIN_MAPS "/ma_accel_burst");

/* MA_STAT_* -> count, node-wide. Written by sk_msg; read by the agent
 * (agent/redirect/maps.py accel_stats: inspect, tests, bench). */
#define MA_STAT_REDIRECTED 0     /* messages redirected */
#define MA_STAT_REDIRECTED_B 1   /* bytes redirected */
#define MA_STAT_PASSED 2         /* messages on switched-off ends (TCP) */
#define MA_STAT_OFF_SIZE 3       /* ends switched off: message over accel_max_msg */
#define MA_STAT_OFF_BURST 4      /* ends switched off: over MA_ACCEL_BURST unanswered */
#define MA_STAT_OFF_NO_PEER 5    /* ends switched off: peer not in ma_accel_socks */
#define MA_STAT_OFF_CONFIG 6     /* ends switched off: pod config gone or not accelerated */
#define MA_STAT_OFF_FULL 7       /* ends switched off: ma_accel_sent full */
#define MA_STAT_RETURNED 8       /* written by the agent: ends it took out of the sockhash */
#define MA_STAT_PAIRED 9         /* messages a paired app end sent straight to the other leg */
#define MA_STATS 10
BPF_TABLE_PINNED("array", __u32, __u64, ma_accel_stats, MA_STATS, MA_PIN_MAPS "/ma_accel_stats");

static __always_inline void ma_count(__u32 idx, __u64 n)
{
    __u64 *v = ma_accel_stats.lookup(&idx);
    if (v)
        __sync_fetch_and_add(v, n);
}

static __always_inline int ma_switch_off(struct ma_sock_key *self, __u32 why)
{
    __u32 off = MA_ACCEL_OFF;
    ma_accel_state.update(self, &off);
    ma_accel_burst.delete(self);
    ma_count(why, 1);
    ma_count(MA_STAT_PASSED, 1);
    return SK_PASS;
}

MA_DEFINE_IP4_OF(ma_msg_ip4, struct sk_msg_md)
MA_DEFINE_SOCK_KEY_OF(ma_msg_key, ma_msg_ip4, struct sk_msg_md)

/* The paired relay (meshagent.h): 1 when the message went straight out of the
 * other leg's socket, 0 when it goes the usual way (to the worker). `ps` is this
 * end's own entry (only sockops deletes it, under this socket's lock); the
 * worker's ma_pair_ctl entry is copied before its owner is checked, so a
 * deleted and reused one is never acted on. */
static __always_inline int ma_pair_send(struct sk_msg_md *msg, struct ma_sock_key *self,
                                        struct ma_pair_state *ps)
{
    __u32 size = msg->size;
    if (ps->mode == MA_PAIR_WORKER) {
        struct ma_pair_ctl *ctl = ma_pair_ctl.lookup(self);
        if (!ctl) {
            ps->passed += size;
            return 0;
        }
        __u64 consumed = ctl->consumed;
        struct ma_sock_key target = ctl->target;
        ma_barrier();
        if (!ma_sock_key_eq(&ctl->owner, self) || consumed != ps->passed) {
            ps->passed += size;
            return 0;
        }
        ps->target = target;
        ps->mode = MA_PAIR_DIRECT;
    }
    if (ps->mode != MA_PAIR_DIRECT)
        return 0;
    struct ma_sock_key to = ps->target;
    if (ma_accel_socks.msg_redirect_hash(msg, &to, 0) != SK_PASS) {
        ps->mode = MA_PAIR_BROKEN;
        return 0;
    }
    ps->moved += size;
    ma_count(MA_STAT_PAIRED, 1);
    return 1;
}

int ma_sk_msg(struct sk_msg_md *msg)
{
    struct ma_sock_key self = {};
    if (!ma_msg_key(msg, &self))
        return SK_PASS;
    /* in place: the sender's socket is locked while its program runs */
    struct ma_pair_state *ps = ma_pair_state.lookup(&self);
    if (ps && ma_pair_send(msg, &self, ps))
        return SK_PASS;
    __u32 *state = ma_accel_state.lookup(&self);
    if (state && *state == MA_ACCEL_OFF) {
        ma_count(MA_STAT_PASSED, 1);
        return SK_PASS;
    }
    struct ma_pod_config *cfg = ma_cfg_netns.lookup(&self.netns);
    if (!cfg || !(cfg->flags & MA_F_ACCEL))
        return ma_switch_off(&self, MA_STAT_OFF_CONFIG);
    __u32 size = msg->size;
    if (size > cfg->accel_max_msg)
        return ma_switch_off(&self, MA_STAT_OFF_SIZE);
    __u32 sent = size;
    __u32 *burst = ma_accel_burst.lookup(&self);
    if (burst)
        sent += *burst;
    if (sent > MA_ACCEL_BURST)
        return ma_switch_off(&self, MA_STAT_OFF_BURST);
    if (!ma_accel_sent.lookup(&self)) {
        __u32 one = 1;
        if (ma_accel_sent.update(&self, &one))
            return ma_switch_off(&self, MA_STAT_OFF_FULL);
    }
    struct ma_sock_key peer = {};
    peer.netns = self.netns;
    peer.local_ip = self.remote_ip;
    peer.remote_ip = self.local_ip;
    peer.local_port = self.remote_port;
    peer.remote_port = self.local_port;
    if (ma_accel_socks.msg_redirect_hash(msg, &peer, BPF_F_INGRESS) != SK_PASS)
        return ma_switch_off(&self, MA_STAT_OFF_NO_PEER);
    /* in place: the sender's socket is locked while its program runs */
    if (burst)
        *burst = sent;
    else
        ma_accel_burst.update(&self, &sent);
    __u32 *answered = ma_accel_burst.lookup(&peer);
    if (answered)
        *answered = 0;
    ma_count(MA_STAT_REDIRECTED, 1);
    ma_count(MA_STAT_REDIRECTED_B, size);
    return SK_PASS;
}
