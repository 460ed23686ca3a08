"""CPU model of the persistent Gluon backward's cross-tile synchronisation (kernel.py; no GPU, no Triton).

The producer, the two consumer warpgroups, the bulk copies into shared memory (TMA loads) and the bulk reads out of
it (dQ reduce-adds, EPI_TMA dK / dV stores) run as coroutines over modelled mbarriers (phase parity waits, arrival
counts, expect-tx), with the kernel's exact buffer / stage / phase formulas, under random interleavings:
  * K buffers (K_STAGES) and V buffers (V_STAGES): tile counter tc, buffer tc % STAGES, parity (tc // STAGES) & 1;
    V released by both consumers after the tile's last dP^T, K after the tile's last item;
  * the Q / dO / lse / delta ring (NUM_STAGES): running item counter g over all tiles;
  * the dS^T double buffer and its join barrier (count 2): buffer g % 2, parity g & 1;
  * each consumer's dQ staging buffer: tma.store_wait(0) before every write, bulk reads in flight after.
Checks: no deadlock; every read sees the contents it expects (tile, item) for its whole use window (a wgmma from
issue to retirement); no copy lands in, and no thread writes, a buffer still in use; every bulk read sees the
contents it was issued for. Mutations of the protocol must be caught (run with --mutations).

    python3 protocol_sim.py [runs] [--mutations]
"""
import random
import sys


class Bar:
    """An mbarrier: `count` arrivals (an expect is one arrival plus a transaction the copy completes) end a phase."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "too many arrivals in one phase"
        self._maybe_complete()

    def expect(self):
        self.tx += 1
        self.arrive()

    def tx_done(self):
        assert self.tx > 0
        self.tx -= 1
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def passes(self, parity):  # mbarrier.wait(parity) returns iff the phase of that parity has completed
        return (self.phases & 1) != parity


class Hazard(AssertionError):
    pass


def check(cond, what):
    if not cond:
        raise Hazard(what)


def run(seed, tiles, KS=2, VS=1, NS=2, dq_mode=1, epi_tma=False, epi_both=False, mutation=None):
    """One random interleaving of a program walking `tiles` (number of ring items of each tile)."""
    rng = random.Random(seed)
    k_ready = [Bar(1) for _ in range(KS)]
    k_empty = [Bar(1 if mutation == "k_empty_count1" else 2) for _ in range(KS)]
    v_ready = [Bar(1) for _ in range(VS)]
    v_empty = [Bar(2) for _ in range(VS)]
    q_ready = [Bar(1) for _ in range(NS)]
    do_ready = [Bar(2) for _ in range(NS)]  # dO copy + the producer's lse / delta stores
    qd_empty = [Bar(2) for _ in range(NS)]
    ds_bar = Bar(2)
    mem = {}  # buffer -> contents tag
    users = {}  # buffer -> number of uses in progress (wgmma in flight, or a thread's read window)
    pending_reads = [[], []]  # per consumer: bulk reads (dQ reduce-add, dK / dV store) not yet done reading
    asyncs = []  # in-flight copies and bulk reads (coroutines)
    dq_adds = []

    def use(buf, expect):
        check(mem.get(buf) == expect, f"{buf} holds {mem.get(buf)}, expected {expect}")
        users[buf] = users.get(buf, 0) + 1

    def unuse(buf, expect):
        check(mem.get(buf) == expect, f"{buf} changed to {mem.get(buf)} while in use (expected {expect})")
        users[buf] -= 1

    def write(buf, tag):
        check(users.get(buf, 0) == 0, f"write of {tag} into {buf} while in use (holds {mem.get(buf)})")
        mem[buf] = tag

    def copy(buf, tag, bar):  # TMA load: lands at a random later time
        def co():
            yield
            write(buf, tag)
            bar.tx_done()
        asyncs.append(co())

    def bulk_read(wg, bufs, tags):  # bulk copy out of shared memory: reads at a random later time
        entry = object()
        pending_reads[wg].append(entry)
        for b, t in zip(bufs, tags):
            use(b, t)

        def co():
            yield
            for b, t in zip(bufs, tags):
                unuse(b, t)
            pending_reads[wg].remove(entry)
        asyncs.append(co())

    def store_wait(wg):  # tma.store_wait(0): every bulk read this consumer issued has read its buffer
        return lambda: not pending_reads[wg]

    def producer():
        g = 0
        for tc, n_it in enumerate(tiles):
            if mutation == "g_reset":
                g = 0
            kb, vb = tc % KS, tc % VS
            yield (k_empty[kb], ((tc // KS) & 1) ^ 1)
            k_ready[kb].expect()
            copy(("K", kb), ("k", tc), k_ready[kb])
            yield (v_empty[vb], ((tc // VS) & 1) ^ (0 if mutation == "v_parity" else 1))
            v_ready[vb].expect()
            copy(("V", vb), ("v", tc), v_ready[vb])
            for it in range(n_it):
                gi = g + it
                s, ph = gi % NS, (gi // NS) & 1
                yield (qd_empty[s], ph ^ 1)
                q_ready[s].expect()
                copy(("Q", s), ("q", tc, it), q_ready[s])
                do_ready[s].expect()
                copy(("dO", s), ("do", tc, it), do_ready[s])
                write(("lse", s), ("lse", tc, it))  # plain stores by the producer warp
                write(("dlt", s), ("dlt", tc, it))
                do_ready[s].arrive()
            g += n_it

    def consumer(wg):
        g = 0
        for tc, n_it in enumerate(tiles):
            kb, vb = tc % KS, tc % VS
            K, V = ("K", kb), ("V", vb)
            yield (k_ready[kb], (tc // KS) & 1)
            yield (v_ready[vb], (tc // VS) & 1)
            for it in range(n_it):
                gi = g + it
                s, ph = gi % NS, (gi // NS) & 1
                Q, dO, lse, dlt = ("Q", s), ("dO", s), ("lse", s), ("dlt", s)
                yield (q_ready[s], ph)
                use(K, ("k", tc))  # S^T = K_mine Q^T
                use(Q, ("q", tc, it))
                yield (do_ready[s], ph)
                use(V, ("v", tc))  # dP^T = V_mine dO^T
                use(dO, ("do", tc, it))
                last = it == n_it - 1
                if mutation == "v_early" and last:
                    v_empty[vb].arrive()  # released before dP^T retired
                yield  # S^T retires
                unuse(K, ("k", tc))
                use(lse, ("lse", tc, it))
                unuse(lse, ("lse", tc, it))
                yield  # dP^T retires
                unuse(V, ("v", tc))
                if last and mutation != "v_early":
                    v_empty[vb].arrive()
                use(dlt, ("dlt", tc, it))
                unuse(dlt, ("dlt", tc, it))
                # dV += P^T dO and dK += dS^T Q in flight (register A operands); dS^T half -> smem
                b = 0 if mutation == "ds_single" else gi % 2
                DS = ("dS", b, wg)
                write(DS, ("ds", gi))
                ds_bar.arrive()
                yield (ds_bar, gi & 1)
                does_dq = dq_mode == 1 or gi % 2 == wg
                if does_dq:  # dQ = dS K reads both halves and K
                    use(("dS", b, 0), ("ds", gi))
                    use(("dS", b, 1), ("ds", gi))
                    use(K, ("k", tc))
                yield  # every wgmma of the item retires (the item's full wait)
                unuse(Q, ("q", tc, it))
                unuse(dO, ("do", tc, it))
                if does_dq:
                    unuse(("dS", b, 0), ("ds", gi))
                    unuse(("dS", b, 1), ("ds", gi))
                    unuse(K, ("k", tc))
                qd_empty[s].arrive()
                if does_dq:
                    yield store_wait(wg)
                    write(("stage", wg, 0), ("dq", gi))  # the whole staging buffer
                    write(("stage", wg, 1), ("dq", gi))
                    bulk_read(wg, [("stage", wg, 0), ("stage", wg, 1)], [("dq", gi)] * 2)
                    dq_adds.append((tc, it, wg))
            k_empty[kb].arrive()  # after the tile's last item: no wgmma reads K any more
            if epi_tma:
                yield store_wait(wg)
                write(("stage", wg, 0), ("dk", tc))
                bulk_read(wg, [("stage", wg, 0)], [("dk", tc)])
                if epi_both:  # both tiles fit: dV into the second half, no wait
                    write(("stage", wg, 1), ("dv", tc))
                    bulk_read(wg, [("stage", wg, 1)], [("dv", tc)])
                else:
                    if mutation != "no_epi_wait":
                        yield store_wait(wg)
                    write(("stage", wg, 0), ("dv", tc))
                    bulk_read(wg, [("stage", wg, 0)], [("dv", tc)])
            g += n_it
        yield store_wait(wg)  # the kernel's final tma.store_wait(0)

    agents = [producer(), consumer(0), consumer(1)]
    waiting = [None] * 3
    done = [False] * 3
    steps = 0
    while not all(done) or asyncs:
        steps += 1
        assert steps < 10 ** 6

        def ready(i):
            w = waiting[i]
            return w is None or (w() if callable(w) else w[0].passes(w[1]))

        choices = [("a", i) for i in range(3) if not done[i] and ready(i)] + [("c", j) for j in range(len(asyncs))]
        if not choices:
            raise Hazard(f"DEADLOCK: tiles={tiles} waiting={waiting}")
        kind, i = rng.choice(choices)
        if kind == "c":
            co = asyncs.pop(i)
            try:
                next(co)
                asyncs.append(co)  # started: finishes on a later pick
            except StopIteration:
                pass
            continue
        try:
            waiting[i] = next(agents[i])
        except StopIteration:
            done[i] = True
            waiting[i] = None
    expect = [(tc, it, wg) for tc, n in enumerate(tiles) for it in range(n) for wg in (0, 1)
              if dq_mode == 1 or (sum(tiles[:tc]) + it) % 2 == wg]
    check(sorted(dq_adds) == sorted(expect), "dQ reduce-adds: some item missing or repeated")


def random_config(rng):
    return dict(KS=rng.choice((1, 2)), VS=rng.choice((1, 2)), NS=rng.choice((2, 3)), dq_mode=rng.choice((0, 1)),
                epi_tma=rng.random() < 0.5, epi_both=rng.random() < 0.5)


def random_tiles(rng):
    return [rng.randint(1, 5) for _ in range(rng.randint(1, 7))]


MUTATIONS = {  # mutation -> config it needs to be observable
    "v_early": dict(VS=1),  # V released before the last dP^T retired
    "k_empty_count1": dict(KS=1),  # K released by the first consumer alone
    "g_reset": {},  # the producer restarts its ring counter every tile
    "ds_single": {},  # one dS buffer instead of two
    "no_epi_wait": dict(epi_tma=True, epi_both=False),  # dV written over dK before dK's bulk store read it
    "v_parity": {},  # the producer's V empty wait without the initial-phase flip
}


def check_mutations(runs=400):
    for name, need in MUTATIONS.items():
        rng = random.Random(7)
        caught = 0
        for seed in range(runs):
            cfg = dict(random_config(rng), **need)
            try:
                run(seed, random_tiles(rng), mutation=name, **cfg)
            except AssertionError:  # a Hazard, or a barrier getting more arrivals than its count in one phase
                caught += 1
        assert caught, f"mutation {name!r} was never caught"
        print(f"mutation {name:15s}: caught in {caught}/{runs} runs")


def tile(t, N, BH, HS):  # gluon_kernels._tile with CAUSAL=False, in Python
    sec = t // (HS * N)
    h0 = sec * HS
    hs = min(BH - h0, HS)
    r = t - sec * (HS * N)
    i = r // hs
    return i, h0 + (r - i * hs)


def check_tiles():
    for N in (1, 3, 8, 9, 128):
        for BH in (1, 4, 5, 16, 32):
            for HS in (1, 2, 3, 4, 7, 16, 32):
                HS = min(HS, BH)
                got = [tile(t, N, BH, HS) for t in range(N * BH)]
                assert sorted(got) == [(n, b) for n in range(N) for b in range(BH)], (N, BH, HS)
                # key blocks ascending inside each section of HS heads (the longest-first order under causal)
                for t in range(1, N * BH):
                    if t // (HS * N) == (t - 1) // (HS * N):
                        assert got[t][0] >= got[t - 1][0]
    print("tile order: a bijection onto (key block, batch * kv head), key blocks ascending in each head section")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = int(args[0]) if args else 3000
    rng = random.Random(1)
    for seed in range(runs):
        run(seed, random_tiles(rng), **random_config(rng))
    print(f"protocol_sim: {runs} random interleavings (1-7 tiles of 1-5 items; K_STAGES, V_STAGES 1-2, NUM_STAGES 2-3, "
          f"DQ_MODE 0/1, EPI_TMA on/off): no deadlock, no buffer hazard, every item's dQ added once")
    for cfg in (dict(KS=2, VS=1, NS=2, dq_mode=1), dict(KS=2, VS=2, NS=2, dq_mode=0)):  # D=128 and D=64 as compiled
        for epi in (False, True):
            for seed in range(500):
                run(seed, random_tiles(rng), epi_tma=epi, epi_both=cfg["dq_mode"] == 0, **cfg)
    print("protocol_sim: the compiled configurations (D=128: K 2, V 1, DQ_MODE 1; D=64: K 2, V 2, DQ_MODE 0) x "
          "EPI_TMA: 2000 more runs, clean")
    check_tiles()
    if "--mutations" in sys.argv:
        check_mutations()


if __name__ == "__main__":
    main()
