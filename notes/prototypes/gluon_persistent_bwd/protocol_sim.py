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


def make_program(rng, asyncs, tile_items, tiles, KS=2, VS=1, NS=2, dq_mode=1, epi_tma=False, epi_both=False,
                 mutation=None, dynamic=None, TS=2):
    """The three agents (producer, consumer 0, consumer 1) of one program and the check run at its end.
    tile_items[t]: ring items of tile t. Static (dynamic None): the program walks `tiles` (tile indices) in order.
    Dynamic: dynamic = (first tile, fetch) where fetch() is the fetch-and-add on the shared tile counter plus nprog;
    the producer makes it after the tile's K load and hands every tile index (and the final one, >= the number
    of tiles) to the consumers through the ring of TS slots with tile_ready (count 1) / tile_empty (count 2)."""
    NT = len(tile_items)
    k_ready = [Bar(1) for _ in range(KS)]
    k_empty = [Bar(1 if mutation == "k_empty_count1" else 2) for _ in range(KS)]
    v_ready = [Bar(1) for _ in range(VS)]
    v_empty = [Bar(2) for _ in range(VS)]
    q_ready = [Bar(1) for _ in range(NS)]
    do_ready = [Bar(2) for _ in range(NS)]  # dO copy + the producer's lse / delta stores
    qd_empty = [Bar(2) for _ in range(NS)]
    ds_bar = Bar(2)
    tile_ready = [Bar(1) for _ in range(TS)]
    tile_empty = [Bar(1 if mutation == "tile_empty_count1" else 2) for _ in range(TS)]
    mem = {}  # buffer -> contents tag
    users = {}  # buffer -> number of uses in progress (wgmma in flight, or a thread's read window)
    pending_reads = [[], []]  # per consumer: bulk reads (dQ reduce-add, dK / dV store) not yet done reading
    dq_adds = []
    done_tiles = [[], [], []]  # tile sequence of the producer and of each consumer

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

    def post(tc, t):  # _tile_post
        slot = tc % TS
        par = ((tc // TS) & 1) ^ (0 if mutation == "tile_parity" else 1)
        yield (tile_empty[slot], par)
        write(("T", slot), t)
        tile_ready[slot].arrive()

    def take(tc, box):  # _tile_take: the value lands in box[0]
        slot = tc % TS
        yield (tile_ready[slot], (tc // TS) & 1)
        if mutation == "tile_release_early":
            tile_empty[slot].arrive()
            yield  # the read happens after the release
        box[0] = mem.get(("T", slot))
        check(isinstance(box[0], int), f"tile slot {slot} read before it was written")
        if mutation != "tile_release_early":
            tile_empty[slot].arrive()

    def producer():
        g = tc = 0
        seq = iter(tiles or ())
        t = dynamic[0] if dynamic else next(seq, NT)
        while t < NT:
            if dynamic:
                yield from post(tc, t)
            tt = t
            done_tiles[0].append(tt)
            n_it = tile_items[tt]
            if mutation == "g_reset":
                g = 0
            kb, vb = tc % KS, tc % VS
            yield (k_empty[kb], ((tc // KS) & 1) ^ 1)
            k_ready[kb].expect()
            copy(("K", kb), ("k", tt), k_ready[kb])
            if dynamic:
                nxt = dynamic[1]()  # the fetch-and-add, after the K load
                yield  # its latency
            else:
                nxt = next(seq, NT)
            yield (v_empty[vb], ((tc // VS) & 1) ^ (0 if mutation == "v_parity" else 1))
            v_ready[vb].expect()
            copy(("V", vb), ("v", tt), v_ready[vb])
            for it in range(n_it):
                gi = g + it
                s, ph = gi % NS, (gi // NS) & 1
                yield (qd_empty[s], ph ^ 1)
                q_ready[s].expect()
                copy(("Q", s), ("q", tt, it), q_ready[s])
                do_ready[s].expect()
                copy(("dO", s), ("do", tt, it), do_ready[s])
                write(("lse", s), ("lse", tt, it))  # plain stores by the producer warp
                write(("dlt", s), ("dlt", tt, it))
                do_ready[s].arrive()
            g += n_it
            tc += 1
            t = nxt
        if dynamic and mutation != "no_stop":
            yield from post(tc, t)  # the stop index

    def consumer(wg):
        g = tc = 0
        seq = iter(tiles or ())
        box = [None]
        if dynamic:
            yield from take(tc, box)
        else:
            box[0] = next(seq, NT)
        while box[0] < NT:
            tt = box[0]
            check(0 <= tt < NT, f"consumer {wg} got tile {tt}")
            done_tiles[1 + wg].append(tt)
            check(not dynamic or (len(done_tiles[0]) > tc and done_tiles[0][tc] == tt),  # posted before
                  f"consumer {wg}'s tile {tc} is {tt}, the producer's {done_tiles[0][tc:tc + 1]}")
            n_it = tile_items[tt]
            kb, vb = tc % KS, tc % VS
            K, V = ("K", kb), ("V", vb)
            yield (k_ready[kb], (tc // KS) & 1)
            yield (v_ready[vb], (tc // VS) & 1)
            for it in range(n_it):
                gi = g + it
                s, ph = gi % NS, (gi // NS) & 1
                Q, dO, lse, dlt = ("Q", s), ("dO", s), ("lse", s), ("dlt", s)
                yield (q_ready[s], ph)
                use(K, ("k", tt))  # S^T = K_mine Q^T
                use(Q, ("q", tt, it))
                yield (do_ready[s], ph)
                use(V, ("v", tt))  # dP^T = V_mine dO^T
                use(dO, ("do", tt, it))
                last = it == n_it - 1
                if mutation == "v_early" and last:
                    v_empty[vb].arrive()  # released before dP^T retired
                yield  # S^T retires
                unuse(K, ("k", tt))
                use(lse, ("lse", tt, it))
                unuse(lse, ("lse", tt, it))
                yield  # dP^T retires
                unuse(V, ("v", tt))
                if last and mutation != "v_early":
                    v_empty[vb].arrive()
                use(dlt, ("dlt", tt, it))
                unuse(dlt, ("dlt", tt, it))
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
                    use(K, ("k", tt))
                yield  # every wgmma of the item retires (the item's full wait)
                unuse(Q, ("q", tt, it))
                unuse(dO, ("do", tt, it))
                if does_dq:
                    unuse(("dS", b, 0), ("ds", gi))
                    unuse(("dS", b, 1), ("ds", gi))
                    unuse(K, ("k", tt))
                qd_empty[s].arrive()
                if does_dq:
                    yield store_wait(wg)
                    write(("stage", wg, 0), ("dq", gi))  # the whole staging buffer
                    write(("stage", wg, 1), ("dq", gi))
                    bulk_read(wg, [("stage", wg, 0), ("stage", wg, 1)], [("dq", gi)] * 2)
                    dq_adds.append((tt, it, wg, gi))
            k_empty[kb].arrive()  # after the tile's last item: no wgmma reads K any more
            if epi_tma:
                yield store_wait(wg)
                write(("stage", wg, 0), ("dk", tt))
                bulk_read(wg, [("stage", wg, 0)], [("dk", tt)])
                if epi_both:  # both tiles fit: dV into the second half, no wait
                    write(("stage", wg, 1), ("dv", tt))
                    bulk_read(wg, [("stage", wg, 1)], [("dv", tt)])
                else:
                    if mutation != "no_epi_wait":
                        yield store_wait(wg)
                    write(("stage", wg, 0), ("dv", tt))
                    bulk_read(wg, [("stage", wg, 0)], [("dv", tt)])
            g += n_it
            tc += 1
            box = [None]
            if dynamic:
                yield from take(tc, box)
            else:
                box[0] = next(seq, NT)
        yield store_wait(wg)  # the kernel's final tma.store_wait(0)

    def final_check():
        check(done_tiles[1] == done_tiles[0] and done_tiles[2] == done_tiles[0],
              f"tile sequences differ: {done_tiles}")
        items = [(t, it) for t in done_tiles[0] for it in range(tile_items[t])]
        gis = {key: gi for gi, key in enumerate(items)}
        expect = [(t, it, wg, gis[(t, it)]) for (t, it) in items for wg in (0, 1)
                  if dq_mode == 1 or gis[(t, it)] % 2 == wg]
        check(sorted(dq_adds) == sorted(expect), "dQ reduce-adds: some item missing or repeated")
        return done_tiles[0]

    return [producer(), consumer(0), consumer(1)], final_check


def schedule(rng, agents, asyncs, what):
    """Random interleaving of agents (generators yielding None, a (Bar, parity) wait or a predicate) and of the
    in-flight copies / bulk reads, until all are done; a state where nothing can move is a deadlock."""
    waiting = [None] * len(agents)
    done = [False] * len(agents)
    steps = 0
    while not all(done) or asyncs:
        steps += 1
        assert steps < 10 ** 7

        def ready(i):
            w = waiting[i]
            return w is None or (w() if callable(w) else w[0].passes(w[1]))

        choices = [("a", i) for i in range(len(agents)) if not done[i] and ready(i)]
        choices += [("c", j) for j in range(len(asyncs))]
        if not choices:
            raise Hazard(f"DEADLOCK: {what} waiting={waiting}")
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


def run(seed, tiles, KS=2, VS=1, NS=2, dq_mode=1, epi_tma=False, epi_both=False, mutation=None):
    """One random interleaving of a program walking a static list of tiles (`tiles`: ring items of each)."""
    rng = random.Random(seed)
    asyncs = []
    agents, final = make_program(rng, asyncs, tiles, list(range(len(tiles))), KS, VS, NS, dq_mode, epi_tma,
                                 epi_both, mutation)
    schedule(rng, agents, asyncs, f"tiles={tiles}")
    final()


def run_dynamic(seed, tile_items, nprog, KS=2, VS=1, NS=2, dq_mode=1, epi_tma=False, epi_both=False, mutation=None,
                TS=2):
    """nprog programs with the dynamic scheduler, sharing one tile counter, under one random interleaving (so the
    tile each fetch returns is random): no deadlock, no hazard in any program, every tile done exactly once, all
    three partitions of a program walk the same tiles and stop together."""
    rng = random.Random(seed)
    ctr = [0]

    def fetch():
        v = ctr[0]
        ctr[0] += 1
        return nprog + v

    asyncs, agents, finals = [], [], []
    for pid in range(nprog):
        a, f = make_program(rng, asyncs, tile_items, None, KS, VS, NS, dq_mode, epi_tma, epi_both, mutation,
                            dynamic=(pid, fetch), TS=TS)
        agents += a
        finals.append(f)
    schedule(rng, agents, asyncs, f"dynamic nprog={nprog} tiles={tile_items}")
    got = sorted(t for f in finals for t in f())
    check(got == list(range(len(tile_items))), f"tiles done {got}, expected each of {len(tile_items)} once")
    check(ctr[0] == len(tile_items), f"{ctr[0]} fetches for {len(tile_items)} tiles")  # each program: tiles + 1 - 1


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


DYN_MUTATIONS = {  # mutations of the dynamic scheduler's tile ring (run_dynamic)
    "tile_empty_count1": {},  # a tile slot reused once one consumer read it
    "tile_parity": {},  # the producer's tile_empty wait without the initial-phase flip
    "no_stop": {},  # no final (stop) index posted: the consumers wait forever
    "tile_release_early": {},  # a consumer releases the slot before it read the index
}


def random_dynamic(rng):
    tile_items = [rng.randint(1, 5) for _ in range(rng.randint(1, 12))]
    return tile_items, rng.randint(1, min(4, len(tile_items)))


def check_mutations(runs=400):
    for name, need in DYN_MUTATIONS.items():
        rng = random.Random(11)
        caught = 0
        for seed in range(runs):
            cfg = dict(random_config(rng), **need)
            tile_items, nprog = random_dynamic(rng)
            try:
                run_dynamic(seed, tile_items, nprog, mutation=name, **cfg)
            except AssertionError:
                caught += 1
        assert caught, f"mutation {name!r} was never caught"
        print(f"mutation {name:18s}: caught in {caught}/{runs} runs (dynamic)")
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
        print(f"mutation {name:18s}: caught in {caught}/{runs} runs")


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
    for seed in range(runs):
        tile_items, nprog = random_dynamic(rng)
        run_dynamic(seed, tile_items, nprog, **random_config(rng))
    for cfg in (dict(KS=2, VS=1, NS=2, dq_mode=1), dict(KS=2, VS=2, NS=2, dq_mode=0)):
        for epi in (False, True):
            for seed in range(300):
                tile_items, nprog = random_dynamic(rng)
                run_dynamic(seed, tile_items, nprog, epi_tma=epi, epi_both=cfg["dq_mode"] == 0, **cfg)
    print(f"protocol_sim: DYNAMIC, {runs} + 1200 random interleavings of 1-4 programs sharing one tile counter over 1-12 "
          f"tiles of 1-5 items (random fetch order; tile ring of 2): no deadlock, no hazard, every tile done once, "
          f"the three partitions of each program walk the same tiles and stop together")
    check_tiles()
    if "--mutations" in sys.argv:
        check_mutations()


if __name__ == "__main__":
    main()
