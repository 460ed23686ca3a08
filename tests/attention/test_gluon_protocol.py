"""CPU models of the persistent Gluon kernels' cross-tile barrier protocols (ejgen.runtime.attention.gluon.kernels;
no GPU, no Triton), run under random interleavings.

Each model runs the kernel's partitions (the producer warp, the two consumer warpgroups) and the in-flight bulk
copies as coroutines over modelled mbarriers (phase-parity waits, arrival counts, expect-tx), with the kernel's
exact stage / phase / turn formulas, and a random scheduler picks which one moves next. Checks: no deadlock; every
read sees the (tile, block) contents it expects for its whole use window; no copy lands in, and no thread writes,
a buffer still in use. Broken variants of each protocol (a wrong parity, a missing arrival, an early release)
must be caught: that is what shows the models can fail.

  * forward (`gluon_attention_fwd_kernel`): the K/V ring counted across tiles, the two Q sets, the O epilogue
    through the Q buffer, the PP_SYNC turn token (issues alternate C0, C1, C0, ... across tiles); with DYNAMIC,
    1-4 programs (one maybe late) taking tiles from a shared counter, each index handed to the consumers in the
    tile slots of its Q buffers and a stop index after the last;
  * persistent backward (`gluon_attention_bwd_persistent_kernel`): K and V buffers per tile, the Q / dO / lse /
    delta ring and the dS^T double buffer counted across tiles, the dQ staging buffers and their bulk reads,
    the EPI_TMA epilogue, and the dynamic tile scheduler (1-4 programs sharing an atomic tile counter, tile
    indices handed from the producer to the consumers through a ring of tile slots);
  * both: the tile order (`_tile`) is a bijection onto the tiles.

Stage counts and the compiled configurations come from ejgen.runtime.attention.gluon.host. The design notes are
notes/gluon-persistent-fwd.md and notes/gluon-persistent-bwd.md.
"""

from __future__ import annotations

import random

import pytest

from ejgen.runtime.attention.gluon import host

FWD_STAGES = host.TILES["NUM_STAGES"]
Q_SETS = 2  # the forward's Q buffers: two sets of two 64-row halves (kernels.py)
TILE_STAGES = 2  # the persistent backward's tile-index ring (TILE_STAGES in gluon_attention_bwd_persistent_kernel)


class Hazard(AssertionError):
    """A protocol violation found by a model: a deadlock, or a buffer read or written at the wrong time."""


def check(cond, what):
    if not cond:
        raise Hazard(what)


class Bar:
    """An mbarrier: `count` arrivals end a phase (an expect is one arrival plus a transaction its copy
    completes)."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phases = count, count, 0, 0

    def arrive(self):
        self.pending -= 1
        check(self.pending >= 0, "too many arrivals in one phase")
        self._maybe_complete()

    def expect(self):
        self.tx += 1
        self.arrive()

    def tx_done(self):
        check(self.tx > 0, "a transaction completed that nobody expected")
        self.tx -= 1
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.count

    def passes(self, parity):
        """mbarrier.wait(parity) returns iff the phase of that parity has completed (a fresh barrier: wait(1)
        returns at once)."""
        return (self.phases & 1) != parity


def schedule(rng, agents, asyncs, what):
    """Random interleaving of agents (generators yielding None, a (Bar, parity) wait or a predicate) and of the
    in-flight copies (generators: started on one pick, done on a later one) until all are done; a state where
    nothing can move is a deadlock."""
    waiting = [None] * len(agents)
    done = [False] * len(agents)
    steps = 0
    while not all(done) or asyncs:
        steps += 1
        check(steps < 10**6, f"livelock: {what}")

        def ready(i):
            w = waiting[i]
            return w is None or (w() if callable(w) else w[0].passes(w[1]))

        choices = [("a", i) for i in range(len(agents)) if not done[i] and ready(i)]
        choices += [("c", j) for j in range(len(asyncs))]
        check(choices, f"deadlock: {what}")
        kind, i = rng.choice(choices)
        if kind == "c":
            co = asyncs.pop(i)
            try:
                next(co)
                asyncs.append(co)
            except StopIteration:
                pass
            continue
        try:
            waiting[i] = next(agents[i])
        except StopIteration:
            done[i] = True
            waiting[i] = None


def random_tiles(rng, most=7):
    """Key blocks (forward) or ring items (backward) of each of 1-`most` tiles."""
    return [rng.randint(1, 5) for _ in range(rng.randint(1, most))]


# --- forward ------------------------------------------------------------------------------------------------


def fwd_program(asyncs, blocks, stages=FWD_STAGES, mutation=None, dynamic=None):
    """The three partitions (producer, consumer 0, consumer 1) of one program of the persistent forward, and the
    check run at its end (returns the tiles it computed). blocks[t]: key blocks of tile t. Static (dynamic None):
    the program walks every tile in order. Dynamic (DYNAMIC): dynamic = (fetch, start), fetch() the fetch-and-add
    on the launch's shared tile counter, start a predicate before which the program does not start (a late
    program); the producer takes every tile (the first too) by a fetch, the next one right after the tile's Q
    loads, writes each index into the tile slots of the tile's two Q buffers before the expect that publishes
    it, and the final one (>= the number of tiles) into the next Q set's slots with plain arrives; each consumer
    reads its half's slot after its q_ready wait and stops at an index >= the number of tiles."""
    nt = len(blocks)
    k_ready = [Bar(1) for _ in range(stages)]
    v_ready = [Bar(1) for _ in range(stages)]
    k_empty = [Bar(2) for _ in range(stages)]
    v_empty = [Bar(2) for _ in range(stages)]
    q_ready = [Bar(1) for _ in range(2 * Q_SETS)]
    q_empty = [Bar(1) for _ in range(2 * Q_SETS)]
    turn = [Bar(1), Bar(1)]
    k_buf, v_buf, q_buf = [None] * stages, [None] * stages, [None] * (2 * Q_SETS)
    slot = [None] * (2 * Q_SETS)  # DYNAMIC: each Q buffer's tile slot
    k_users, v_users = [0] * stages, [0] * stages  # consumers whose use of the stage has begun and not ended
    q_busy = [False] * (2 * Q_SETS)
    issues = []
    walked = [[], [], []]  # tiles of the producer and of each consumer
    stores = []  # (tile, half) of every O store

    def copy(buf, i, tag, bar, users=None):
        def co():
            yield  # lands at a random later time
            check(users is None or users[i] == 0, f"copy of {tag} overwrites a buffer in use")
            buf[i] = tag
            bar.tx_done()

        asyncs.append(co())

    def fetch():
        t = dynamic[0]()
        yield  # the atomic's round trip
        return t

    def producer():
        g = tc = 0
        if dynamic:
            yield dynamic[1]
            t = yield from fetch()
        else:
            t = 0
        while t < nt:
            n = blocks[t]
            walked[0].append(t)
            if mutation == "g_reset":
                g = 0
            qb, qp = (tc % Q_SETS) * 2, (tc // Q_SETS) & 1
            for h in range(2):
                yield (q_empty[qb + h], qp if mutation == "q_parity" else qp ^ 1)
                check(q_empty[qb + h].phases == tc // Q_SETS, f"q_empty {qb + h}: phase {q_empty[qb + h].phases} "
                      f"read for tile {tc}")
                check(not q_busy[qb + h], f"Q buffer {qb + h} refilled while in use")
                if dynamic and mutation != "slot_after_arrive":
                    slot[qb + h] = t
                q_ready[qb + h].expect()
                copy(q_buf, qb + h, ("q", tc, t, h), q_ready[qb + h])
                if dynamic and mutation == "slot_after_arrive":
                    yield  # the Q copy may land first
                    slot[qb + h] = t
            if dynamic:
                nxt = yield from fetch()
            else:
                nxt = t + 1
            for it in range(n):
                gi = g + it
                idx, ph = gi % stages, (gi // stages) & 1
                yield (k_empty[idx], ph ^ 1)
                k_ready[idx].expect()
                copy(k_buf, idx, ("k", tc, it), k_ready[idx], k_users)
                yield (v_empty[idx], ph ^ 1)
                v_ready[idx].expect()
                copy(v_buf, idx, ("v", tc, it), v_ready[idx], v_users)
            g += n
            tc += 1
            t = nxt
        if dynamic and mutation != "no_stop":
            qb, qp = (tc % Q_SETS) * 2, (tc // Q_SETS) & 1
            for h in range(2):  # the stop index
                if mutation != "stop_no_wait":
                    yield (q_empty[qb + h], qp ^ 1)
                slot[qb + h] = t
                q_ready[qb + h].arrive()

    def take(tc, half):
        qi = (tc % Q_SETS) * 2 + half
        if mutation == "slot_before_wait":
            t = slot[qi]
            yield (q_ready[qi], (tc // Q_SETS) & 1)
        else:
            yield (q_ready[qi], (tc // Q_SETS) & 1)
            t = slot[qi]
        check(q_ready[qi].phases == tc // Q_SETS + 1, f"q_ready {qi}: phase {q_ready[qi].phases} read for tile {tc}")
        check(t is not None, f"tile slot {qi} read before it was written")
        return t

    def consumer(half):
        mine, other = turn[half], turn[1 - half]
        turn0 = 1 if half == 0 or mutation == "turn_offset" else 0
        g = tc = 0
        if dynamic:
            t = yield from take(tc, half)
        else:
            t = 0
        while t < nt:
            n = blocks[t]
            walked[1 + half].append(t)
            qi = (tc % Q_SETS) * 2 + half
            if not dynamic:
                yield (q_ready[qi], (tc // Q_SETS) & 1)
            check(len(walked[0]) > tc and walked[0][tc] == t,
                  f"consumer {half}'s tile {tc} is {t}, the producer's {walked[0][tc:tc + 1]}")
            check(q_buf[qi] == ("q", tc, t, half), f"Q buffer {qi} holds {q_buf[qi]}, expected tile {tc}")
            q_busy[qi] = True
            idx = g % stages  # block 0: S only
            yield (mine, (g + turn0) & 1)
            yield (k_ready[idx], (g // stages) & 1)
            check(k_buf[idx] == ("k", tc, 0), f"K stage {idx} holds {k_buf[idx]}, expected {('k', tc, 0)}")
            k_users[idx] += 1
            issues.append(half)
            other.arrive()
            yield  # the S wgmma in flight
            check(k_buf[idx] == ("k", tc, 0), "K changed under the S wgmma")
            k_users[idx] -= 1
            k_empty[idx].arrive()
            for it in range(1, n):
                gi = g + it
                idx, ph = gi % stages, (gi // stages) & 1
                prev, pph = (gi - 1) % stages, ((gi - 1) // stages) & 1
                yield (mine, (gi + turn0) & 1)
                yield (k_ready[idx], ph)
                check(k_buf[idx] == ("k", tc, it), f"K stage {idx} holds {k_buf[idx]}, expected {('k', tc, it)}")
                k_users[idx] += 1
                yield (v_ready[prev], pph)
                check(v_buf[prev] == ("v", tc, it - 1), f"V stage {prev} holds {v_buf[prev]}")
                v_users[prev] += 1
                issues.append(half)
                other.arrive()
                yield  # S_j in flight
                check(k_buf[idx] == ("k", tc, it), "K changed under the S wgmma")
                k_users[idx] -= 1
                k_empty[idx].arrive()
                yield  # the softmax under P_{j-1} V_{j-1}
                check(v_buf[prev] == ("v", tc, it - 1), "V changed under the P V wgmma")
                v_users[prev] -= 1
                v_empty[prev].arrive()
            gl = g + n - 1  # the tile's last P V, outside the turn protocol
            last = gl % stages
            yield (v_ready[last], (gl // stages) & 1)
            check(v_buf[last] == ("v", tc, n - 1), f"V stage {last} holds {v_buf[last]}")
            v_users[last] += 1
            yield
            v_users[last] -= 1
            v_empty[last].arrive()
            # epilogue: O through the Q buffer, bulk store, store_wait, then the Q buffer goes back
            check(q_buf[qi] == ("q", tc, t, half), "Q buffer changed before the epilogue")
            q_buf[qi] = ("o", tc, t, half)
            if mutation == "q_release_early":
                q_busy[qi] = False
                q_empty[qi].arrive()
            yield  # the bulk store reads the buffer
            check(q_buf[qi] == ("o", tc, t, half), "Q buffer overwritten before the O store read it")
            stores.append((t, half))
            if mutation != "q_release_early":
                q_busy[qi] = False
                q_empty[qi].arrive()
            g += n
            tc += 1
            if dynamic:
                t = yield from take(tc, half)
            else:
                t = tc

    def final_check():
        check(walked[1] == walked[0] and walked[2] == walked[0], f"the partitions walked different tiles: {walked}")
        check(issues == [0, 1] * sum(blocks[t] for t in walked[0]),
              f"turn token: the issues do not alternate: {issues}")
        check(sorted(stores) == sorted((t, h) for t in walked[0] for h in (0, 1)), f"O stores {stores}")
        return walked[0]

    return [producer(), consumer(0), consumer(1)], final_check


def fwd_run(seed, tiles, stages=FWD_STAGES, mutation=None):
    """One program of the persistent forward walking `tiles` (key blocks of each) under one random
    interleaving."""
    rng = random.Random(seed)
    asyncs = []
    agents, final = fwd_program(asyncs, tiles, stages, mutation)
    schedule(rng, agents, asyncs, f"forward tiles={tiles}")
    check(final() == list(range(len(tiles))), "the static program skipped a tile")


def fwd_run_dynamic(seed, blocks, nprog, stages=FWD_STAGES, mutation=None, late=None):
    """nprog programs of the forward with DYNAMIC sharing one tile counter under one random interleaving (so the
    tile each fetch returns is random); program `late` (if any) starts only once a random number of tiles were
    taken, maybe all of them. Every tile computed exactly once (both halves), no deadlock, no hazard, no barrier
    phase misread in any program; the counter ends at tiles + programs (one fetch per tile, one stop each)."""
    rng = random.Random(seed)
    ctr = [0]
    nt = len(blocks)

    def fetch():
        ctr[0] += 1
        return ctr[0] - 1

    start_at = rng.randint(0, nt)
    asyncs, agents, finals = [], [], []
    for pid in range(nprog):
        start = (lambda: ctr[0] >= start_at) if pid == late else None
        a, f = fwd_program(asyncs, blocks, stages, mutation, dynamic=(fetch, start))
        agents += a
        finals.append(f)
    schedule(rng, agents, asyncs, f"forward dynamic nprog={nprog} late={late} tiles={blocks}")
    got = sorted(t for f in finals for t in f())
    check(got == list(range(nt)), f"tiles computed {got}, expected each of {nt} once")
    check(ctr[0] == nt + nprog, f"{ctr[0]} fetches for {nt} tiles and {nprog} programs")


def random_forward_dynamic(rng, most=16):
    """Uneven tiles (1-6 key blocks) for 1-4 programs, half the time one of several late (it waits for the others'
    fetches: a single program cannot be)."""
    blocks = [rng.randint(1, 6) for _ in range(rng.randint(1, most))]
    nprog = rng.randint(1, min(4, len(blocks)))
    return blocks, nprog, (rng.randrange(nprog) if nprog > 1 and rng.random() < 0.5 else None)


FWD_MUTATIONS = {  # mutation -> what it breaks
    "g_reset": "the producer restarts its ring counter every tile",
    "q_parity": "the producer's q_empty wait without the initial-phase flip",
    "turn_offset": "both consumers start with the same turn parity",
    "q_release_early": "the Q buffer released before the O bulk store read it",
}
# races that need the producer tiles ahead: one block each
SHORT_TILES = {"q_release_early", "tile_release_early", "stop_no_wait"}


@pytest.mark.parametrize("stages", sorted({FWD_STAGES, 3}))
def test_forward_protocol_under_random_interleavings(stages):
    rng = random.Random(stages)
    for seed in range(600 if stages == FWD_STAGES else 200):
        fwd_run(seed, random_tiles(rng), stages)


@pytest.mark.parametrize("mutation", FWD_MUTATIONS)
def test_forward_model_catches_a_broken_protocol(mutation):
    rng = random.Random(7)
    runs, caught = 100, 0
    for seed in range(runs):
        try:
            fwd_run(seed, [1] * 7 if mutation in SHORT_TILES else random_tiles(rng), mutation=mutation)
        except AssertionError:
            caught += 1
    assert caught >= runs // 20, f"{FWD_MUTATIONS[mutation]}: caught in {caught}/{runs} runs only"


@pytest.mark.parametrize("stages", sorted({FWD_STAGES, 3}))
def test_forward_dynamic_tile_queue_under_random_interleavings(stages):
    rng = random.Random(100 + stages)
    for seed in range(300 if stages == FWD_STAGES else 100):
        blocks, nprog, late = random_forward_dynamic(rng)
        fwd_run_dynamic(seed, blocks, nprog, stages, late=late)


def test_forward_dynamic_tile_queue_gives_a_late_program_fewer_tiles():
    """The point of the queue: a program that starts once most tiles are taken does fewer of them."""
    def run(seed, blocks):
        ctr = [0]

        def fetch():
            ctr[0] += 1
            return ctr[0] - 1

        asyncs, agents, finals = [], [], []
        for pid in range(3):
            start = (lambda: ctr[0] >= 16) if pid == 2 else None
            a, f = fwd_program(asyncs, blocks, dynamic=(fetch, start))
            agents += a
            finals.append(f)
        schedule(random.Random(seed), agents, asyncs, "late program")
        return [f() for f in finals]

    late_tiles = []
    for seed in range(40):
        done = run(seed, [3] * 24)
        assert sorted(t for d in done for t in d) == list(range(24))
        late_tiles.append(len(done[2]))
    assert max(late_tiles) <= 8 and sum(late_tiles) < 40 * 24 / 3, late_tiles  # a static split gives it 8 each time


FWD_DYNAMIC_MUTATIONS = {  # mutation -> what it breaks
    "slot_after_arrive": "the tile index written after the expect that publishes it",
    "slot_before_wait": "a consumer reads its tile slot before its q_ready wait",
    "stop_no_wait": "the stop index posted without waiting for the Q set's release",
    "no_stop": "no stop index: the consumers wait forever",
    "g_reset": "the producer restarts its ring counter every tile",
    "q_parity": "the producer's q_empty wait without the initial-phase flip",
}


@pytest.mark.parametrize("mutation", FWD_DYNAMIC_MUTATIONS)
def test_forward_dynamic_model_catches_a_broken_protocol(mutation):
    rng = random.Random(13)
    runs, caught = 100, 0
    for seed in range(runs):
        blocks, nprog, late = random_forward_dynamic(rng)
        if mutation in SHORT_TILES:
            blocks = [1] * 12
        try:
            fwd_run_dynamic(seed, blocks, nprog, mutation=mutation, late=late)
        except AssertionError:
            caught += 1
    assert caught >= runs // 20, f"{FWD_DYNAMIC_MUTATIONS[mutation]}: caught in {caught}/{runs} runs only"


def fwd_tile(t, n_m, bh, hs, causal):
    """kernels._tile in Python."""
    sec = t // (hs * n_m)
    h0 = sec * hs
    hsec = min(bh - h0, hs)
    r = t - sec * (hs * n_m)
    i_m = r // hsec
    return (n_m - 1 - i_m if causal else i_m), h0 + (r - i_m * hsec)


def test_tile_order_is_a_bijection_with_longest_tiles_first():
    for n_m in (1, 3, 8, 9, 128):
        for bh in (1, 4, 5, 16, 32):
            for hs in {min(x, bh) for x in (1, 2, 3, 4, 7, 16, 32)}:
                for causal in (False, True):
                    got = [fwd_tile(t, n_m, bh, hs, causal) for t in range(n_m * bh)]
                    assert sorted(got) == [(m, b) for m in range(n_m) for b in range(bh)], (n_m, bh, hs, causal)
                    # within a section of hs heads: query tiles descending under causal (heaviest first),
                    # ascending otherwise (the backward's key blocks: ascending is its longest-first order)
                    for t in range(1, n_m * bh):
                        if t // (hs * n_m) == (t - 1) // (hs * n_m):
                            step = got[t][0] - got[t - 1][0]
                            assert (step <= 0) if causal else (step >= 0), (n_m, bh, hs, causal, t)


# --- persistent backward ------------------------------------------------------------------------------------


def bwd_program(asyncs, tile_items, tiles, ks, vs, ns, dq_mode, epi_tma, epi_both, mutation=None, dynamic=None,
                ts=TILE_STAGES, order=None):
    """The three partitions (producer, consumer 0, consumer 1) of one program and the check run at its end.
    tile_items[t]: ring items (query blocks) of tile t. Static (dynamic None): the program walks `tiles` in
    order. Dynamic: dynamic = (first tile, fetch), fetch() the fetch-and-add on the shared tile counter plus
    nprog; the producer makes it after the tile's K load and hands every tile index (and the final one, >= the
    number of tiles) to the consumers through the ring of `ts` slots, tile_ready (count 1) / tile_empty
    (count 2). order (segment ids, `gluon_attention_bwd_persistent_kernel` with SEGMENTS): the places the counter
    hands out are places in this list of tiles (`host.bwd_order`); the producer posts order[place], the tile, and
    tiles may have no item (a key block no query sees: its consumers release V themselves)."""
    nt = len(tile_items)
    k_ready = [Bar(1) for _ in range(ks)]
    k_empty = [Bar(1 if mutation == "k_empty_count1" else 2) for _ in range(ks)]
    v_ready = [Bar(1) for _ in range(vs)]
    v_empty = [Bar(2) for _ in range(vs)]
    q_ready = [Bar(1) for _ in range(ns)]
    do_ready = [Bar(2) for _ in range(ns)]  # the dO copy + the producer's lse / delta stores
    qd_empty = [Bar(2) for _ in range(ns)]
    ds_bar = Bar(2)
    tile_ready = [Bar(1) for _ in range(ts)]
    tile_empty = [Bar(1 if mutation == "tile_empty_count1" else 2) for _ in range(ts)]
    mem = {}  # buffer -> contents tag
    users = {}  # buffer -> uses in progress (a wgmma in flight, a thread's read, a bulk read)
    pending_reads = [[], []]  # per consumer: bulk reads (dQ reduce-add, dK / dV store) still reading
    dq_adds = []
    walked = [[], [], []]  # the tiles of the producer and of each consumer

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

    def post(tc, t):  # _pbwd_tile_post
        slot = tc % ts
        par = ((tc // ts) & 1) ^ (0 if mutation == "tile_parity" else 1)
        yield (tile_empty[slot], par)
        write(("T", slot), t)
        tile_ready[slot].arrive()

    def take(tc, box):  # _pbwd_tile_take: the index lands in box[0]
        slot = tc % ts
        yield (tile_ready[slot], (tc // ts) & 1)
        if mutation == "tile_release_early":
            tile_empty[slot].arrive()
            yield  # the read comes after the release
        box[0] = mem.get(("T", slot))
        check(isinstance(box[0], int), f"tile slot {slot} read before it was written")
        if mutation != "tile_release_early":
            tile_empty[slot].arrive()

    def producer():
        g = tc = 0
        seq = iter(tiles or ())
        t = dynamic[0] if dynamic else next(seq, nt)
        while t < nt:
            place = t
            if order is not None:
                t = order[place]  # the ORDER load: the ring carries the tile, not the place
            if dynamic:
                yield from post(tc, t)
            walked[0].append(t)
            n_it = tile_items[t]
            if mutation == "g_reset":
                g = 0
            kb, vb = tc % ks, tc % vs
            yield (k_empty[kb], ((tc // ks) & 1) ^ 1)
            k_ready[kb].expect()
            copy(("K", kb), ("k", t), k_ready[kb])
            if dynamic:
                nxt = dynamic[1]()  # the fetch-and-add, after the K load
                yield  # its latency
            else:
                nxt = next(seq, nt)
            del place
            yield (v_empty[vb], ((tc // vs) & 1) ^ (0 if mutation == "v_parity" else 1))
            v_ready[vb].expect()
            copy(("V", vb), ("v", t), v_ready[vb])
            for it in range(n_it):
                gi = g + it
                s, ph = gi % ns, (gi // ns) & 1
                yield (qd_empty[s], ph ^ 1)
                q_ready[s].expect()
                copy(("Q", s), ("q", t, it), q_ready[s])
                do_ready[s].expect()
                copy(("dO", s), ("do", t, it), do_ready[s])
                write(("lse", s), ("lse", t, it))  # plain stores by the producer warp
                write(("dlt", s), ("dlt", t, it))
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
            box[0] = next(seq, nt)
        while box[0] < nt:
            t = box[0]
            check(0 <= t < nt, f"consumer {wg} got tile {t}")
            walked[1 + wg].append(t)
            check(not dynamic or (len(walked[0]) > tc and walked[0][tc] == t),
                  f"consumer {wg}'s tile {tc} is {t}, the producer's {walked[0][tc:tc + 1]}")
            n_it = tile_items[t]
            kb, vb = tc % ks, tc % vs
            K, V = ("K", kb), ("V", vb)
            yield (k_ready[kb], (tc // ks) & 1)
            yield (v_ready[vb], (tc // vs) & 1)
            for it in range(n_it):
                gi = g + it
                s, ph = gi % ns, (gi // ns) & 1
                Q, dO, lse, dlt = ("Q", s), ("dO", s), ("lse", s), ("dlt", s)
                yield (q_ready[s], ph)
                use(K, ("k", t))  # S^T = K_mine Q^T
                use(Q, ("q", t, it))
                yield (do_ready[s], ph)
                use(V, ("v", t))  # dP^T = V_mine dO^T
                use(dO, ("do", t, it))
                last = it == n_it - 1
                if mutation == "v_early" and last:
                    v_empty[vb].arrive()  # released before dP^T retired
                yield  # S^T retires
                unuse(K, ("k", t))
                use(lse, ("lse", t, it))
                unuse(lse, ("lse", t, it))
                yield  # dP^T retires
                unuse(V, ("v", t))
                if last and mutation != "v_early":
                    v_empty[vb].arrive()
                use(dlt, ("dlt", t, it))
                unuse(dlt, ("dlt", t, it))
                # dV += P^T dO and dK += dS^T Q in flight (register A operands); this half of dS^T -> smem
                b = 0 if mutation == "ds_single" else gi % 2
                DS = ("dS", b, wg)
                write(DS, ("ds", gi))
                ds_bar.arrive()
                yield (ds_bar, gi & 1)
                does_dq = dq_mode == 1 or gi % 2 == wg
                if does_dq:  # dQ = dS K reads both halves and K
                    use(("dS", b, 0), ("ds", gi))
                    use(("dS", b, 1), ("ds", gi))
                    use(K, ("k", t))
                yield  # every wgmma of the item retires (the item's full wait)
                unuse(Q, ("q", t, it))
                unuse(dO, ("do", t, it))
                if does_dq:
                    unuse(("dS", b, 0), ("ds", gi))
                    unuse(("dS", b, 1), ("ds", gi))
                    unuse(K, ("k", t))
                qd_empty[s].arrive()
                if does_dq:
                    yield store_wait(wg)
                    write(("stage", wg, 0), ("dq", gi))  # the whole staging buffer
                    write(("stage", wg, 1), ("dq", gi))
                    bulk_read(wg, [("stage", wg, 0), ("stage", wg, 1)], [("dq", gi)] * 2)
                    dq_adds.append((t, it, wg, gi))
            if n_it == 0 and mutation != "empty_keeps_v":  # no last dP^T released V: the tile gives it back
                v_empty[vb].arrive()
            k_empty[kb].arrive()  # after the tile's last item: no wgmma reads K any more
            if epi_tma:
                yield store_wait(wg)
                write(("stage", wg, 0), ("dk", t))
                bulk_read(wg, [("stage", wg, 0)], [("dk", t)])
                if epi_both:  # both tiles fit: dV into the second half, no wait
                    write(("stage", wg, 1), ("dv", t))
                    bulk_read(wg, [("stage", wg, 1)], [("dv", t)])
                else:
                    if mutation != "no_epi_wait":
                        yield store_wait(wg)
                    write(("stage", wg, 0), ("dv", t))
                    bulk_read(wg, [("stage", wg, 0)], [("dv", t)])
            g += n_it
            tc += 1
            box = [None]
            if dynamic:
                yield from take(tc, box)
            else:
                box[0] = next(seq, nt)
        yield store_wait(wg)  # the kernel's final tma.store_wait(0)

    def final_check():
        check(walked[1] == walked[0] and walked[2] == walked[0], f"the partitions walked different tiles: {walked}")
        items = [(t, it) for t in walked[0] for it in range(tile_items[t])]
        gis = {key: gi for gi, key in enumerate(items)}
        expect = [(t, it, wg, gis[(t, it)]) for (t, it) in items for wg in (0, 1)
                  if dq_mode == 1 or gis[(t, it)] % 2 == wg]
        check(sorted(dq_adds) == sorted(expect), "dQ reduce-adds: an item missing or repeated")
        return walked[0]

    return [producer(), consumer(0), consumer(1)], final_check


def bwd_run(seed, tiles, ks=2, vs=1, ns=2, dq_mode=1, epi_tma=False, epi_both=False, mutation=None):
    """One program walking a static list of tiles (`tiles`: ring items of each) under one random interleaving."""
    rng = random.Random(seed)
    asyncs = []
    agents, final = bwd_program(asyncs, tiles, list(range(len(tiles))), ks, vs, ns, dq_mode, epi_tma, epi_both,
                                mutation)
    schedule(rng, agents, asyncs, f"backward tiles={tiles}")
    final()


def bwd_run_dynamic(seed, tile_items, nprog, ks=2, vs=1, ns=2, dq_mode=1, epi_tma=False, epi_both=False,
                    mutation=None, order=None):
    """nprog programs with the dynamic scheduler sharing one tile counter under one random interleaving (so the
    tile each fetch returns is random): no deadlock, no hazard in any program, every tile done exactly once,
    the three partitions of a program walk the same tiles and stop together."""
    rng = random.Random(seed)
    ctr = [0]

    def fetch():
        ctr[0] += 1
        return nprog + ctr[0] - 1

    asyncs, agents, finals = [], [], []
    for pid in range(nprog):
        a, f = bwd_program(asyncs, tile_items, None, ks, vs, ns, dq_mode, epi_tma, epi_both, mutation,
                           dynamic=(pid, fetch), order=order)
        agents += a
        finals.append(f)
    schedule(rng, agents, asyncs, f"dynamic nprog={nprog} tiles={tile_items}")
    got = sorted(t for f in finals for t in f())
    check(got == list(range(len(tile_items))), f"tiles done {got}, expected each of {len(tile_items)} once")
    check(ctr[0] == len(tile_items), f"{ctr[0]} fetches for {len(tile_items)} tiles")


def random_config(rng):
    """K_STAGES, V_STAGES 1-2, NUM_STAGES 2-3, DQ_MODE 0/1, EPI_TMA on/off (both dK and dV tiles in the staging
    buffer at once or not)."""
    return dict(ks=rng.choice((1, 2)), vs=rng.choice((1, 2)), ns=rng.choice((2, 3)), dq_mode=rng.choice((0, 1)),
                epi_tma=rng.random() < 0.5, epi_both=rng.random() < 0.5)


def random_dynamic(rng):
    tile_items = random_tiles(rng, most=12)
    return tile_items, rng.randint(1, min(4, len(tile_items)))


PBWD_K_STAGES = 2  # the persistent backward's K buffers (a constant of the kernel)


def compiled_configs():
    """The persistent backward's configurations as the launch compiles them (head dims 64 and 128): K double
    buffered, dK / dV stored from registers (no bulk-store epilogue)."""
    configs = []
    for d in host.HEAD_DIMS:
        c = host.pbwd_constexprs(batch=2, hq=16, hkv=16, seq=16384, d=d)
        configs.append(pytest.param(dict(ks=PBWD_K_STAGES, vs=c["V_STAGES"], ns=c["NUM_STAGES"],
                                         dq_mode=c["DQ_MODE"], epi_tma=False, epi_both=False),
                                    id=f"D{d}-K{PBWD_K_STAGES}V{c['V_STAGES']}-dq{c['DQ_MODE']}"))
    return configs


def test_backward_protocol_under_random_interleavings():
    rng = random.Random(1)
    for seed in range(500):
        bwd_run(seed, random_tiles(rng), **random_config(rng))


def test_backward_dynamic_scheduler_under_random_interleavings():
    rng = random.Random(2)
    for seed in range(300):
        tile_items, nprog = random_dynamic(rng)
        bwd_run_dynamic(seed, tile_items, nprog, **random_config(rng))


@pytest.mark.parametrize("config", compiled_configs())
def test_backward_protocol_as_compiled(config):
    rng = random.Random(3)
    for seed in range(100):
        bwd_run(seed, random_tiles(rng), **config)
    for seed in range(60):
        tile_items, nprog = random_dynamic(rng)
        bwd_run_dynamic(seed, tile_items, nprog, **config)


BWD_MUTATIONS = {  # mutation -> (what it breaks, the config it needs to be observable, dynamic scheduler)
    "v_early": ("V released before the tile's last dP^T retired", dict(vs=1), False),
    "k_empty_count1": ("K released by the first consumer alone", dict(ks=1), False),
    "g_reset": ("the producer restarts its ring counter every tile", {}, False),
    "ds_single": ("one dS^T buffer instead of two", {}, False),
    "no_epi_wait": ("dV written over dK before dK's bulk store read it", dict(epi_tma=True, epi_both=False), False),
    "v_parity": ("the producer's v_empty wait without the initial-phase flip", {}, False),
    "tile_empty_count1": ("a tile slot reused once one consumer read it", {}, True),
    "tile_parity": ("the producer's tile_empty wait without the initial-phase flip", {}, True),
    "no_stop": ("no stop index posted: the consumers wait forever", {}, True),
    "tile_release_early": ("a consumer releases its tile slot before it read the index", {}, True),
}


@pytest.mark.parametrize("mutation", BWD_MUTATIONS)
def test_backward_model_catches_a_broken_protocol(mutation):
    what, need, dynamic = BWD_MUTATIONS[mutation]
    rng = random.Random(11)
    runs, caught = 100, 0
    for seed in range(runs):
        cfg = dict(random_config(rng), **need)
        try:
            if dynamic:
                tile_items, nprog = random_dynamic(rng)
                if mutation in SHORT_TILES:
                    tile_items = [1] * 12
                bwd_run_dynamic(seed, tile_items, nprog, mutation=mutation, **cfg)
            else:
                bwd_run(seed, random_tiles(rng), mutation=mutation, **cfg)
        except AssertionError:
            caught += 1
    assert caught >= runs // 20, f"{what}: caught in {caught}/{runs} runs only"


def test_backward_tile_order_is_a_bijection_with_key_blocks_ascending():
    """The persistent backward walks (key block, batch * kv head) tiles in _tile's order with CAUSAL=False."""
    for n in (1, 3, 8, 9, 128):
        for bh in (1, 4, 5, 16, 32):
            for hs in {min(x, bh) for x in (1, 2, 3, 4, 7, 16, 32)}:
                got = [fwd_tile(t, n, bh, hs, False) for t in range(n * bh)]
                assert sorted(got) == [(i, b) for i in range(n) for b in range(bh)], (n, bh, hs)
                assert all(got[t][0] >= got[t - 1][0] for t in range(1, n * bh)
                           if t // (hs * n) == (t - 1) // (hs * n)), (n, bh, hs)


# --- the persistent backward with segment ids (packed documents) ------------------------------------------------


def random_segment_tiles(rng, most=12):
    """Key blocks of uneven work, some of none (a key block no query sees: padding, or under causal), and the
    order the programs take them in: `host.bwd_order`'s most work first, ties in index order."""
    items = [rng.choice((0, 0, 1, 1, 2, 3, 5, 8)) for _ in range(rng.randint(1, most))]
    order = sorted(range(len(items)), key=lambda t: (-items[t], t))
    return items, order


def test_backward_with_segment_ids_walks_its_order_once_under_random_interleavings():
    """The segment ids' persistent backward: uneven tiles (empty ones too) taken in their order through the tile
    counter by 1-4 programs; every (key block, head) tile done exactly once, by one program, no deadlock or
    hazard; and with the compiled configurations (head dims 64 and 128)."""
    rng = random.Random(21)
    configs = [c.values[0] for c in compiled_configs()]
    for seed in range(300):
        items, order = random_segment_tiles(rng)
        nprog = rng.randint(1, min(4, len(items)))
        cfg = random_config(rng) if seed % 2 else rng.choice(configs)
        bwd_run_dynamic(seed, items, nprog, order=order, **cfg)


def test_backward_with_segment_ids_starts_the_heaviest_tiles_first():
    """Places are handed out in counter order, so the tiles start in `bwd_order`'s order: with one program the
    producer walks the order exactly; with several, the first P tiles of the order are the programs' first."""
    rng = random.Random(22)
    for seed in range(100):
        items, order = random_segment_tiles(rng)
        asyncs = []
        ctr = [0]

        def fetch():
            ctr[0] += 1
            return 1 + ctr[0] - 1

        agents, final = bwd_program(asyncs, items, None, 2, 1, 2, 1, False, False, dynamic=(0, fetch), order=order)
        schedule(random.Random(seed), agents, asyncs, f"one program, order {order}")
        assert final() == order


def test_backward_model_catches_an_empty_tile_keeping_its_v_buffer():
    """Mutation: a tile of no item does not give its V buffer back (no last dP^T to release it): deadlock."""
    rng = random.Random(23)
    runs, caught = 60, 0
    for seed in range(runs):
        items, order = random_segment_tiles(rng)
        items = items + [0, 0]  # two empty tiles at least: the second waits for the V the first kept
        order = sorted(range(len(items)), key=lambda t: (-items[t], t))
        try:
            bwd_run_dynamic(seed, items, 1, ks=2, vs=1, ns=2, dq_mode=1, mutation="empty_keeps_v", order=order)
        except AssertionError:
            caught += 1
    assert caught == runs, f"caught in {caught}/{runs} runs only"
