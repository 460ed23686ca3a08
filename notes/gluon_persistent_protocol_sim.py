"""CPU model of the persistent Gluon forward's cross-tile synchronisation (ejgen/runtime/attention/gluon/kernels.py; no GPU,
no Triton): the producer, the two consumers and
the in-flight bulk copies as coroutines over modelled mbarriers (phase parity waits, arrival counts, expect-tx),
with the kernel's exact stage / phase / turn formulas, run under random interleavings. Checks: no deadlock;
every wgmma reads the buffer contents it expects (tile, block) for its whole use window; the producer never
overwrites a K/V stage or a Q buffer still in use; the turn token makes the issues alternate C0, C1, C0, ...

    python3 protocol_sim.py [runs]
"""
import random
import sys

NUM_STAGES = 2


class Bar:
    def __init__(self, count):
        self.count, self.pending, self.tx_armed, self.phases = count, count, False, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "too many arrivals in one phase"
        self._maybe_complete()

    def expect(self):  # mbarrier.expect: one arrival plus a transaction that the copy completes
        assert not self.tx_armed
        self.tx_armed = True
        self.pending -= 1
        assert self.pending >= 0

    def tx_done(self):
        assert self.tx_armed
        self.tx_armed = False
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and not self.tx_armed:
            self.phases += 1
            self.pending = self.count

    def passes(self, parity):  # mbarrier.wait(parity) returns iff that phase parity has completed
        return (self.phases & 1) != parity


def run(seed, n_tiles_list):
    rng = random.Random(seed)
    ntiles = len(n_tiles_list)
    k_ready = [Bar(1) for _ in range(NUM_STAGES)]
    v_ready = [Bar(1) for _ in range(NUM_STAGES)]
    k_empty = [Bar(2) for _ in range(NUM_STAGES)]
    v_empty = [Bar(2) for _ in range(NUM_STAGES)]
    q_ready = [Bar(1) for _ in range(4)]
    q_empty = [Bar(1) for _ in range(4)]
    turn = [Bar(1), Bar(1)]
    k_buf = [None] * NUM_STAGES
    v_buf = [None] * NUM_STAGES
    q_buf = [None] * 4
    k_users = [0] * NUM_STAGES  # consumers whose use of the stage's contents has begun and not ended
    v_users = [0] * NUM_STAGES
    q_busy = [False] * 4
    issues = []
    copies = []

    def copy(buf, i, tag, bar, users=None):
        def co():
            yield None  # completes at a random later time
            assert users is None or users[i] == 0, f"copy overwrites a buffer in use {tag}"
            buf[i] = tag
            bar.tx_done()
        return co()

    def producer():
        g = 0
        for tc, n in enumerate(n_tiles_list):
            qb, qp = (tc % 2) * 2, (tc // 2) & 1
            for h in range(2):
                yield (q_empty[qb + h], qp ^ 1)
                assert not q_busy[qb + h], "Q buffer refilled while in use"
                q_ready[qb + h].expect()
                copies.append(copy(q_buf, qb + h, ("q", tc, h), q_ready[qb + h]))
            for it in range(n):
                gi = g + it
                idx, ph = gi % NUM_STAGES, (gi // NUM_STAGES) & 1
                yield (k_empty[idx], ph ^ 1)
                k_ready[idx].expect()
                copies.append(copy(k_buf, idx, ("k", tc, it), k_ready[idx], k_users))
                yield (v_empty[idx], ph ^ 1)
                v_ready[idx].expect()
                copies.append(copy(v_buf, idx, ("v", tc, it), v_ready[idx], v_users))
            g += n

    def consumer(half):
        mine, other = turn[half], turn[1 - half]
        turn0 = 1 if half == 0 else 0
        g = 0
        for tc, n in enumerate(n_tiles_list):
            qi = (tc % 2) * 2 + half
            yield (q_ready[qi], (tc // 2) & 1)
            assert q_buf[qi] == ("q", tc, half), (q_buf[qi], tc, half)
            q_busy[qi] = True
            # block 0: S only
            idx = g % NUM_STAGES
            yield (mine, (g + turn0) & 1)
            yield (k_ready[idx], (g // NUM_STAGES) & 1)
            assert k_buf[idx] == ("k", tc, 0)
            k_users[idx] += 1
            issues.append(half)
            other.arrive()
            yield None  # the S wgmma in flight
            assert k_buf[idx] == ("k", tc, 0)
            k_users[idx] -= 1
            k_empty[idx].arrive()
            for it in range(1, n):
                gi = g + it
                idx, ph = gi % NUM_STAGES, (gi // NUM_STAGES) & 1
                prev, pph = (gi - 1) % NUM_STAGES, ((gi - 1) // NUM_STAGES) & 1
                yield (mine, (gi + turn0) & 1)
                yield (k_ready[idx], ph)
                assert k_buf[idx] == ("k", tc, it)
                k_users[idx] += 1
                yield (v_ready[prev], pph)
                assert v_buf[prev] == ("v", tc, it - 1)
                v_users[prev] += 1
                issues.append(half)
                other.arrive()
                yield None
                assert k_buf[idx] == ("k", tc, it)
                k_users[idx] -= 1
                k_empty[idx].arrive()
                yield None  # softmax under P V
                assert v_buf[prev] == ("v", tc, it - 1)
                v_users[prev] -= 1
                v_empty[prev].arrive()
            gl = g + n - 1
            last = gl % NUM_STAGES
            yield (v_ready[last], (gl // NUM_STAGES) & 1)
            assert v_buf[last] == ("v", tc, n - 1)
            v_users[last] += 1
            yield None
            v_users[last] -= 1
            v_empty[last].arrive()
            # epilogue: O through the Q buffer, bulk store, store_wait, release
            assert q_buf[qi] == ("q", tc, half)
            q_buf[qi] = ("o", tc, half)
            yield None  # the store reads the buffer
            assert q_buf[qi] == ("o", tc, half), "Q buffer overwritten before the O store read it"
            q_busy[qi] = False
            q_empty[qi].arrive()
            g += n

    agents = [producer(), consumer(0), consumer(1)]
    waiting = [None, None, None]
    done = [False] * 3
    steps = 0
    while not all(done) or copies:
        steps += 1
        assert steps < 10**6
        ready = [i for i in range(3) if not done[i] and (waiting[i] is None or waiting[i][0].passes(waiting[i][1]))]
        choices = [("a", i) for i in ready] + [("c", j) for j in range(len(copies))]
        if not choices:
            raise RuntimeError(f"DEADLOCK seed={seed} tiles={n_tiles_list} waiting={[w and w[1] for w in waiting]}")
        kind, i = rng.choice(choices)
        if kind == "c":
            co = copies.pop(i)
            try:
                next(co)
            except StopIteration:
                continue
            copies.append(co)  # first step done: completes on a later pick
            continue
        try:
            waiting[i] = next(agents[i])
        except StopIteration:
            done[i] = True
            waiting[i] = None
    total = sum(n_tiles_list)
    assert issues == [0, 1] * total, "turn token: issues do not alternate"
    return ntiles


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rng = random.Random(1)
    for seed in range(runs):
        tiles = [rng.randint(1, 5) for _ in range(rng.randint(1, 7))]
        run(seed, tiles)
    print(f"protocol_sim: {runs} random interleavings (1-7 tiles of 1-5 key blocks each): no deadlock, no buffer "
          f"hazard, turn order alternates")


if __name__ == "__main__":
    main()


def tile(t, N_M, BH, HS, causal):  # kernel._tile in Python
    sec = t // (HS * N_M)
    h0 = sec * HS
    hs = min(BH - h0, HS)
    r = t - sec * (HS * N_M)
    i_m = r // hs
    bh = h0 + (r - i_m * hs)
    return (N_M - 1 - i_m if causal else i_m), bh


def check_tiles():
    for N_M in (1, 3, 8, 9, 128):
        for BH in (1, 5, 16, 32):
            for HS in (1, 2, 3, 7, 16, 32):
                HS = min(HS, BH)
                for causal in (False, True):
                    got = [tile(t, N_M, BH, HS, causal) for t in range(N_M * BH)]
                    assert sorted(got) == [(m, b) for m in range(N_M) for b in range(BH)], (N_M, BH, HS)
    print("tile order: a bijection onto (query tile, batch*head) for every tested (N_M, BH, HEAD_GROUP)")


if __name__ == "__main__":
    check_tiles()
