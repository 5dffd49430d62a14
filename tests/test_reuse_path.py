"""The reuse step's call path (issue 14): prefetch in the order calls really arrive (batched and split CFG), no
host-device sync per attention call, the step resolved once per model evaluation (issue 9 defect 5).

A fake sampler run drives the adapter the way ComfyUI does (``comfy/samplers.py`` L209-323): the CALC_COND_BATCH
wrapper gets ``(model, conds, x_in, timestep, model_options)`` and the model evaluation below it calls the installed
override once per block with a per-call copy of transformer_options (``cond_or_uncond``, ``uuids``, ``sigmas``, the
self-attention mark). During the reuse evaluations every host read of a tensor raises, so a per-call ``.item()``
(or ``.tolist()``, ``bool()``, ``float()``, ``torch.cuda.synchronize``, ``nonzero``) on the reuse path fails the test
even on CPU tensors.
"""

import contextlib

import pytest
import torch
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter import lifecycle, override, settings
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.callsite import MARK_KEY, CallSite
from comfyui_mc_sparse_pack.comfyui_mc_sparse.adapter.steps import STEP_KEY
from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import CacheKey
from comfyui_mc_sparse_pack.comfyui_mc_sparse.prefetch import CallOrder

from ._comfy_standins import raw_attention

SEED = 1234


class HostReadError(AssertionError):
    """A host-device sync (a host read of a tensor) happened where none may."""


@contextlib.contextmanager
def no_host_reads():
    """Make every host read of a tensor value raise (the calls that sync with the GPU on CUDA tensors)."""

    def forbid(name):
        def raiser(*args, **kwargs):
            raise HostReadError(f"{name} called on the reuse path (a host-device sync per call on a GPU)")

        return raiser

    patches = [(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")]
    patches += [(torch, "nonzero"), (torch.cuda, "synchronize")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    try:
        for obj, name in patches:
            setattr(obj, name, forbid(f"{getattr(obj, '__name__', obj)}.{name}"))
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def _settings(**over):
    base = dict(preset="custom", density=0.5, dense_warmup="1", warmup_layers=0, anchor_steps="1", query_tile=64,
                cache_placement="auto", backend="auto", min_tokens=0, verbose=False)
    return settings.build_settings(**{**base, **over})


def _fake_sampler_run(run, *, layers, steps, batch_orders, qkv, heads, guard_from_step):
    """Evaluate the model ``steps`` times through the CALC_COND_BATCH wrapper. ``batch_orders``: the forwards of one
    evaluation as lists of cond_or_uncond indices (``[[1, 0]]`` batched CFG, ``[[1], [0]]`` split: ComfyUI runs uncond
    then cond when memory is short, ``comfy/samplers.py`` L255-290), or a function of the step giving them. Host
    reads raise inside evaluations of step >= ``guard_from_step``. Returns the outputs of the last evaluation, per
    forward, and the steps the evaluations saw."""
    model_options = {"transformer_options": {override.RUN_KEY: run}}
    override.install_override(model_options["transformer_options"])
    seen_steps = []
    outs = []

    def evaluate(model, conds, x_in, timestep, model_options):
        topts = model_options["transformer_options"]
        seen_steps.append(topts.get(STEP_KEY))
        guard = no_host_reads() if topts.get(STEP_KEY, -1) >= guard_from_step else contextlib.nullcontext()
        result = []
        orders = batch_orders(topts.get(STEP_KEY)) if callable(batch_orders) else batch_orders
        with guard:
            for order in orders:
                q, k, v = (torch.cat([t[i] for i in order]) for t in qkv)
                for layer in range(layers):
                    call_options = dict(topts, cond_or_uncond=list(order), uuids=[f"uuid{i}" for i in order],
                                        sigmas=timestep)
                    call_options[MARK_KEY] = CallSite(layer, "wan")
                    fn = call_options["optimized_attention_override"]
                    out = fn(raw_attention, q, k, v, heads=heads, transformer_options=call_options)
                result.append(out)
        return result

    for step in range(steps):
        timestep = run.sample_sigmas[step] * torch.ones(1)
        outs = lifecycle.calc_cond_batch_wrapper(evaluate, None, [], None, timestep, model_options)
    return outs, seen_steps


@pytest.mark.parametrize("batch_orders", [[[1, 0]], [[1], [0]]], ids=["cfg-batched", "cfg-split"])
def test_reuse_calls_do_no_host_reads(batch_orders):
    """Reuse evaluations run every attention call without one host read of a tensor (batched and split CFG);
    the step each evaluation sees comes from the CALC_COND_BATCH wrapper, and the reuse output is finite."""
    print(f"seed {SEED}")
    g = torch.Generator().manual_seed(SEED)
    heads, seq, dim = 2, 192, 64
    qkv = [[torch.randn(1, seq, heads * dim, generator=g) for _ in range(2)] for _ in range(3)]  # [tensor][cond]
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]))
    outs, seen = _fake_sampler_run(run, layers=3, steps=4, batch_orders=batch_orders, qkv=qkv, heads=heads,
                                   guard_from_step=1)
    assert seen == [0, 1, 2, 3]
    counts = run.counts()
    assert counts["sparse"] == 3 * 3 * 2 and counts["anchor"] == 3 * 2  # anchor at step 0 (the warm-up step), reuse 1-3
    assert all(bool(torch.isfinite(o).all()) for o in outs)


def test_batched_cfg_reuse_is_one_launch_on_views_without_copies(monkeypatch):
    """Both CFG branches of a batched call go to the sparse kernel in one launch (B = 2, both entries stacked), with
    q/k/v and out as strided [B, H, S, D] views of ComfyUI's [B, S, H*D] tensors (same storage: no copies), the
    residual handed over in its stored form; the override returns the very buffer the kernel wrote."""
    from comfyui_mc_sparse_pack import kernels

    launches = []
    real = kernels.sparse_attention

    def recording(q, k, v, perm, kv_idx, **kw):
        launches.append((q, kw.get("out"), kw.get("residual"), perm.shape[0], kv_idx.shape[0]))
        return real(q, k, v, perm, kv_idx, **kw)

    monkeypatch.setattr(kernels, "sparse_attention", recording)
    g = torch.Generator().manual_seed(SEED)
    heads, seq, dim = 2, 192, 64
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.8, 0.6, 0.0]))
    over = override.make_override(None)
    q, k, v = (torch.randn(2, seq, heads * dim, generator=g) for _ in range(3))
    for sigma in (1.0, 0.8):  # anchor (per branch), then reuse
        launches.clear()
        opts = {override.RUN_KEY: run, MARK_KEY: CallSite(0, "wan"), "cond_or_uncond": [1, 0],
                "uuids": ["u1", "u0"], "sigmas": torch.tensor([sigma])}
        out = over(raw_attention, q, k, v, heads, transformer_options=opts)
    assert len(launches) == 1
    qh, out_h, residual, perm_b, kv_b = launches[0]
    assert qh.shape == (2, heads, seq, dim) and perm_b == kv_b == 2
    assert qh.data_ptr() == q.data_ptr() and not qh.is_contiguous()
    assert out_h is not None and out_h.data_ptr() == out.data_ptr() and out.shape == q.shape
    assert residual is not None and residual.data.shape[0] == 2


def test_host_read_guard_catches_a_per_call_item():
    """The guard is live: a dispatch that reads the sigma per call (the defect) raises under it."""
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.8, 0.6, 0.0]))
    opts = {override.RUN_KEY: run, "sigmas": torch.tensor([0.8])}
    with no_host_reads(), pytest.raises(HostReadError):
        run.step_of(opts)  # no STEP_KEY: falls back to reading the sigma


# --- prefetch order ---------------------------------------------------------------------------------------------

_BATCHED, _SPLIT = [[1, 0]], [[1], [0]]


def _evaluation_groups(orders, layers, windows=(None,), vace=()):
    """The call groups of one model evaluation, as ComfyUI issues them: per context window, per forward (batch of
    conditioning chunks), per block; VACE blocks right after their main block."""
    groups = []
    for window in windows:
        for order in orders:
            for layer in range(layers):
                kinds = ["self"] + (["vace"] if layer in vace else [])
                for kind in kinds:
                    groups.append(tuple(CacheKey(layer, f"uuid{i}", window, (1, 2, 64, 64), kind) for i in order))
    return groups


@pytest.mark.parametrize("anchor_orders,reuse_orders", [(_BATCHED, _BATCHED), (_SPLIT, _SPLIT), (_BATCHED, _SPLIT),
                                                        (_SPLIT, _BATCHED)],
                         ids=["batched", "split", "anchor-batched-reuse-split", "anchor-split-reuse-batched"])
@pytest.mark.parametrize("windows,vace", [((None,), ()), (("w0", "w1"), (1,))], ids=["plain", "windows+vace"])
def test_call_order_predicts_every_reuse_call(anchor_orders, reuse_orders, windows, vace):
    """The prefetch order for batched and split CFG (and context windows, VACE blocks): with the batching of the
    anchor step every reuse call is predicted, the first of each evaluation included; when the batching changed
    after the anchor step, only the first call of the first reuse evaluation may be missed, and once an evaluation
    in the new order has been seen, no prediction is ever wrong again."""
    order = CallOrder()
    layers = 4
    for group in _evaluation_groups(anchor_orders, layers, windows, vace):
        order.anchor_call(group, step=2)
    wrong_per_eval = []
    for _ in range(4):
        wrong = 0
        expected = order.begin_evaluation()  # begin_evaluation's prefetch
        for group in _evaluation_groups(reuse_orders, layers, windows, vace):
            wrong += expected != group
            order.observe(group)
            expected = order.predict(group)  # what the side stream decodes next
        wrong_per_eval.append(wrong)
    same = anchor_orders == reuse_orders
    assert wrong_per_eval[0] == (0 if same else 1), wrong_per_eval
    assert wrong_per_eval[1:] == [0, 0, 0]
    assert order.wrong == wrong_per_eval[0]


def test_call_order_learns_an_order_the_anchor_step_did_not_show():
    """Calls that skip a block at reuse steps (a guidance node dropping uncond's block 2, say): the anchor step's order
    guesses wrong once at the gap, the learned successor is right from the next evaluation on."""
    order = CallOrder()
    for group in _evaluation_groups(_SPLIT, 4):
        order.anchor_call(group, step=0)
    skipped = CacheKey(2, "uuid1", None, (1, 2, 64, 64), "self")
    wrongs = []
    for _ in range(3):
        before = order.wrong
        order.begin_evaluation()
        for group in _evaluation_groups(_SPLIT, 4):
            if group != (skipped,):
                order.observe(group)
                order.predict(group)
        wrongs.append(order.wrong - before)
    assert wrongs == [1, 0, 0], wrongs


def test_call_order_a_later_anchor_step_replaces_the_earlier_record():
    """A second anchor step (anchor_steps "10, 26") with another batching than the first (batched, then split): the
    guesses come from the latest anchor step alone. After its last call the next guess is its own first group
    (cyclically), not the first anchor step's (mutation: the record kept across anchor steps)."""
    order = CallOrder()
    for group in _evaluation_groups(_BATCHED, 3):
        order.anchor_call(group, step=0)
    split = _evaluation_groups(_SPLIT, 3)
    for group in split:
        order.anchor_call(group, step=5)
    assert order.predict(split[-1]) == split[0]


def test_call_order_with_keys_the_anchor_step_never_stored():
    """A call group holding a key no anchor call stored (a block or window that first appears at a reuse step), or an
    empty group: no prediction (None), no error; every prediction handed out is counted once, and a wrong one once.
    Mutations: the unknown-key guard dropped (a KeyError in the engine's prefetch), a prediction counted twice."""
    order = CallOrder()
    for group in _evaluation_groups(_SPLIT, 2):
        order.anchor_call(group, step=0)
    stranger = (CacheKey(7, "uuid0", "w9", (1, 2, 64, 64), "self"),)
    assert order.predict(stranger) is None and order.predict(()) is None
    assert order.predict(_evaluation_groups(_SPLIT, 2)[0] + stranger) is None
    before = order.predictions
    first = order.begin_evaluation()
    order.observe(first)  # right
    nxt = order.predict(first)
    order.observe(stranger)  # wrong
    assert nxt is not None and (order.predictions - before, order.wrong) == (2, 1)


def test_call_order_relearns_when_batching_changes_mid_run():
    """ComfyUI may switch between batched and split CFG from one evaluation to the next (free memory changes): one
    wrong guess at each switch (the first call), none while the mode stays."""
    order = CallOrder()
    for group in _evaluation_groups(_BATCHED, 3):
        order.anchor_call(group, step=0)
    wrongs = []
    for orders in (_BATCHED, _SPLIT, _SPLIT, _BATCHED, _BATCHED, _SPLIT):
        before = order.wrong
        order.begin_evaluation()
        for group in _evaluation_groups(orders, 3):
            order.observe(group)
            order.predict(group)
        wrongs.append(order.wrong - before)
    assert wrongs == [0, 1, 0, 1, 0, 1], wrongs


@pytest.mark.parametrize("anchor_orders,reuse_orders,misses", [(_BATCHED, _BATCHED, 0), (_SPLIT, _SPLIT, 0),
                                                               (_BATCHED, _SPLIT, 1)],
                         ids=["batched", "split", "anchor-batched-reuse-split"])
def test_runner_prefetches_only_the_next_call_cpu_cache(anchor_orders, reuse_orders, misses):
    """Through the adapter with the cache in CPU memory: each reuse load is served by the one group the side stream
    decoded (the hit rate the summary reports), and nothing else is ever decoded ahead (no dropped prefetches)."""
    print(f"seed {SEED}")
    g = torch.Generator().manual_seed(SEED)
    heads, seq, dim, layers, steps = 2, 192, 64, 3, 4
    qkv = [[torch.randn(1, seq, heads * dim, generator=g) for _ in range(2)] for _ in range(3)]
    run = lifecycle.RunState(_settings(cache_placement="cpu"), torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]))
    loader = run.runner.loader
    log = []  # ("decode", group) when the side stream starts a group, ("load", group) when a call reads one
    prefetch, load = loader.prefetch, loader.load

    def record_prefetch(group, device, dtype):
        if group is not None and (loader._pending is None or loader._pending.group != tuple(group)):
            log.append(("decode", tuple(group)))
        return prefetch(group, device, dtype)

    def record_load(group, device, dtype):
        log.append(("load", tuple(group)))
        return load(group, device, dtype)

    loader.prefetch, loader.load = record_prefetch, record_load
    _fake_sampler_run(run, layers=layers, steps=steps, qkv=qkv, heads=heads, guard_from_step=1,
                      batch_orders=lambda step: anchor_orders if step == 0 else reuse_orders)
    entries_per_eval = layers * 2
    assert loader.misses == misses and loader.hits == 3 * entries_per_eval - misses
    # each group the side stream decoded is the one the next call read (the run's last prediction has no next call)
    decodes = [i for i, (what, _) in enumerate(log) if what == "decode"]
    not_next = [log[i][1] for i in decodes[:-1] if next(g for w, g in log[i + 1:] if w == "load") != log[i][1]]
    assert len(not_next) == misses and loader.dropped == 2 * misses  # a switch wastes the one group guessed
    assert f"prefetch hit rate {loader.hit_rate:.1%}" in run.summary()


def _batched_reuse_run(monkeypatch, stack_views: bool):
    """Anchor step then 3 reuse steps of 2 layers with batched CFG; per reuse launch: (step, residual data, output)."""
    from comfyui_mc_sparse_pack import kernels
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import prefetch

    monkeypatch.setattr(prefetch, "STACK_VIEWS", stack_views)
    launches = []
    real = kernels.sparse_attention

    def recording(q, k, v, perm, kv_idx, **kw):
        out = real(q, k, v, perm, kv_idx, **kw)
        if kw.get("residual") is not None:  # reuse launches (the anchor's own sparse evaluation has none)
            launches.append((kw["residual"].data, out.clone()))
        return out

    monkeypatch.setattr(kernels, "sparse_attention", recording)
    g = torch.Generator().manual_seed(SEED)
    heads, seq, dim = 2, 192, 64
    qkv = [[torch.randn(1, seq, heads * dim, generator=g) for _ in range(2)] for _ in range(3)]
    run = lifecycle.RunState(_settings(), torch.tensor([1.0, 0.8, 0.6, 0.4, 0.0]))
    _fake_sampler_run(run, layers=2, steps=4, batch_orders=[[1, 0]], qkv=qkv, heads=heads, guard_from_step=1)
    return run, launches


def test_stacked_residual_is_a_view_of_the_cache_after_the_first_decode(monkeypatch):
    """A batched CFG group's first stacked decode makes the two entries' residuals its rows (no extra memory); every
    later decode of the group hands the kernel a view of those rows (no 2 x residual copy per call), and the outputs
    equal, bit for bit, a run that copies the residuals every call. A decode of the group in the other order copies."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import prefetch

    print(f"seed {SEED}")
    with monkeypatch.context() as m:
        run, views = _batched_reuse_run(m, True)
    with monkeypatch.context() as m:
        _, copies = _batched_reuse_run(m, False)
    assert len(views) == len(copies) == 3 * 2
    for (r_v, o_v), (r_c, o_c) in zip(views, copies):
        assert torch.equal(o_v, o_c) and torch.equal(r_v, r_c)
    cache = run.runner.cache
    shape = (1, 2, 192, 64)
    for layer in range(2):
        group = [cache.get(CacheKey(layer, f"uuid{i}", None, shape)) for i in (1, 0)]
        r1, r0 = (s.residual.data for s in group)
        assert r0.data_ptr() == r1.data_ptr() + r1.numel() * r1.element_size()  # rows of one tensor, in call order
        # the later steps' launches read the cache's own rows
        later = [r for r, _ in views[2:] if r.data_ptr() == r1.data_ptr()]
        assert len(later) == 2 and later[0].shape[0] == 2
        swapped = prefetch._decode_group(group[::-1], r0.device, torch.float32)
        assert swapped.residual.data.data_ptr() not in (r0.data_ptr(), r1.data_ptr())
        assert torch.equal(swapped.residual.data[0], r0[0]) and torch.equal(swapped.residual.data[1], r1[0])


def _kept_run(monkeypatch, budget: int):
    """The batched CFG run of ``_batched_reuse_run`` with ``keep_budget_bytes`` = ``budget`` set before the first
    reuse step; returns (run, launches, decodes of the group stacks)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import prefetch

    decodes = []
    real_decode = prefetch._decode_group

    def counting(stored, device, dtype):
        decodes.append(len(stored))
        return real_decode(stored, device, dtype)

    monkeypatch.setattr(prefetch, "_decode_group", counting)
    real_init = prefetch.ReuseLoader.__init__

    def init(self, cache):
        real_init(self, cache)
        self.keep_budget_bytes = budget

    monkeypatch.setattr(prefetch.ReuseLoader, "__init__", init)
    run, launches = _batched_reuse_run(monkeypatch, True)
    return run, launches, decodes


def test_decoded_groups_kept_within_the_plan_budget(monkeypatch):
    """With a keep budget, each call group is decoded once (its first reuse step) and served from the kept batch at
    every later reuse step (no decode, no prefetch), outputs bit-identical to decoding every step; a budget one byte
    short of a group keeps nothing."""
    print(f"seed {SEED}")
    with monkeypatch.context() as m:
        _, plain, plain_decodes = _kept_run(m, 0)
    with monkeypatch.context() as m:
        run, kept, decodes = _kept_run(m, 1 << 30)
    loader = run.runner.loader
    assert len(decodes) == 2 and len(plain_decodes) >= 3 * 2  # 2 layers decoded once vs every reuse step
    assert loader.kept_loads == 2 * 2 * 2 and loader.kept_bytes > 0  # steps 2-3, 2 layers, 2 entries
    assert "from decoded batches kept on the GPU" in run.summary()
    for (r_k, o_k), (r_p, o_p) in zip(kept, plain):
        assert torch.equal(o_k, o_p)
    one = loader.kept_bytes // 2
    with monkeypatch.context() as m:
        run, _, decodes = _kept_run(m, one - 1)
    assert run.runner.loader.kept_loads == 0 and len(decodes) >= 3 * 2


def test_a_later_anchor_step_drops_the_kept_batches():
    """Kept decoded batches belong to the anchor step that stored their entries: a second anchor step (anchor_steps
    "1, 3") replaces the entries, and the reuse step after it must read the new ones. With a keep budget the outputs
    equal, bit for bit, a run that keeps nothing, at both reuse steps (mutation: ``ReuseLoader.clear`` leaving the
    kept batches: step 4 reused step 1's selection and residual)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import MCSparseRunner

    g = torch.Generator().manual_seed(SEED)
    qkv = [[torch.randn(2, 2, 192, 64, generator=g) for _ in range(3)] for _ in range(4)]  # new q, k, v every step
    keys = [CacheKey(0, "uuid1", None, (1, 2, 192, 64)), CacheKey(0, "uuid0", None, (1, 2, 192, 64))]
    outs = {}
    for budget in (0, 1 << 30):
        runner = MCSparseRunner(MCSparseConfig(density=0.5, group_size=64, warmup_steps=0, anchor_steps=(0, 2)))
        runner.loader.keep_budget_bytes = budget
        outs[budget] = [runner.attention(*qkv[step], step=step, layer=0, keys=keys) for step in range(4)]
        if budget:
            assert runner.loader.kept_bytes > 0 and runner.stats.anchors == [0, 2]
    for step in range(4):
        assert torch.equal(outs[0][step], outs[1 << 30][step]), step


def test_a_prefetch_of_a_missing_entry_is_a_no_op():
    """``ReuseLoader.prefetch`` of a group with an entry the cache does not hold (evicted, or a predicted group of
    keys never stored) starts nothing and raises nothing (mutation: the guard dropped: an AttributeError inside the
    engine's prefetch, which turns the run dense); before any load the hit rate is None (no "0 %" in the summary)."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.cache import MetadataCache
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.prefetch import ReuseLoader

    loader = ReuseLoader(MetadataCache("gpu"))
    assert loader.hit_rate is None
    loader.prefetch((CacheKey(0, "uuid0", None, (1, 2, 64, 64)),), torch.device("cpu"), torch.float32)
    assert loader._pending is None and (loader.hits, loader.misses, loader.dropped) == (0, 0, 0)


def test_keep_budget_from_the_plan():
    """Kept only for a GPU cache whose bytes + working set + every entry's int32 groups and indices take at most half of
    the plan's GPU budget beyond the headroom; never for a CPU cache, a dense plan or an unknown budget."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import memory
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import keep_budget

    est = memory.estimate_cache(heads=12, head_dim=128, layers=30, tokens=32760, density=0.15, group_size=128,
                                kv_tile=64, branches=2, batch=1, warmup_layers=1, index_encoding="auto",
                                residual_dtype="bfloat16", residual=True)
    kept = est.entries * (est.working_bytes // 2 - est.residual_bytes)
    assert kept == est.entries * (est.naive_entry_bytes - 2 * 12 * 32760 * 128) > 0  # the paper layout less its residual
    need = est.total_bytes + est.working_bytes + kept
    headroom = 4 << 30

    def plan(placement, budget, dense=False):
        return memory.CachePlan(None if dense else "bfloat16", None if dense else placement, None if dense else est,
                                {}, budget, 0, headroom, None, ("auto", "auto"))

    assert keep_budget(plan("gpu", 2 * need + headroom)) == kept
    assert keep_budget(plan("gpu", 2 * need + headroom - 2)) == 0
    assert keep_budget(plan("cpu", 10 * need)) == 0
    assert keep_budget(plan("gpu", None)) == 0
    assert keep_budget(plan("gpu", 10 * need, dense=True)) == 0


@pytest.mark.parametrize("preset, density", [("quality", 0.25), ("balanced", 0.2), ("fast", 0.15)])
def test_no_groups_kept_at_14b_720p_whatever_the_free_memory(preset, density):
    """The 14B 720p run that ran out of memory with kept groups (8258d10) keeps none under the plan's rule, even with
    a whole H200 (141 GB) free for the cache: cache (~73 GB) + int32 indices (~87-140 GB) exceed half of it. At 1.3B
    480p with the memory an H200 has left after the 1.3B model, the groups (~3.6 GB) are kept."""
    from comfyui_mc_sparse_pack.comfyui_mc_sparse import memory
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.config import MCSparseConfig
    from comfyui_mc_sparse_pack.comfyui_mc_sparse.engine import keep_budget

    host = memory.HostMemory(available=512 << 30, total=1024 << 30)
    config = MCSparseConfig(density=density, warmup_steps=10, anchor_steps=(9,), warmup_layers=1)
    plan = memory.plan_cache(config, heads=40, head_dim=128, layers=40, tokens=75600, branches=2, batch=1,
                             gpu_free=141 * 10**9, host=host)
    assert not plan.dense and keep_budget(plan) == 0
    small = memory.plan_cache(config, heads=12, head_dim=128, layers=30, tokens=32760, branches=2, batch=1,
                              gpu_free=130 * 10**9, host=host)
    assert small.placement == "gpu" and 2 << 30 < keep_budget(small) < 8 << 30
