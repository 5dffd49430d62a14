"""What the CuTeDSL backend runs, as data (no CUDA or cutlass import: the CPU tests read it).

The kernel (``sparse_fwd_sm90.py``) is built for sm_90: wgmma, setmaxnreg and flash-attn-4's sm90 consumer. It runs
fp16 / bf16, head dim 64 or 128, query groups of exactly 128 (one query tile), Q/K/V rows copied 16 bytes at a time
(unit stride on D, 16-byte aligned rows), output rows written 4 bytes at a time, residual rows read in pairs of
elements, fewer than 2^31 groups in all.
"""

from __future__ import annotations

import os

import torch

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
HEAD_DIMS = (64, 128)
GROUP_SIZE = 128
# "smem": O staged in the query tile, 16-byte stores, taken without a residual (the H200 key-tile sweep: the 4-byte
# scattered stores cost ~3 us per query group, the staged ones ~1.1 us; side by side +0.026 / +0.013 of dense x s at
# 1.3B / 14B s = 0.1; docs/kernels.md); "registers" the alternative (sparse_fwd_sm90.py)
EPILOGUE = "smem"
# compile options (sparse_fwd_sm90.OPTIONS) of the staged-epilogue kernel; with "persistent" the op launches one CTA
# per SM instead of one per group (``launch_plan``). "persistent" since 2026-12-01 15:10 (above the one-CTA-per-group
# kernel at 7 of 8 points in the H200 round of 13:42); + "overlap" (two query groups in flight per CTA) since 15:35:
# H200 round s6r1 (method of record, 5 rounds, side by side; 1.3B 480p s = 0.1 / 0.15 / 0.25 / 0.5) 0.874 / 0.888 /
# 0.918 / 0.925 against the persistent kernel's 0.863 / 0.877 / 0.906 / 0.915; 14B 720p s = 0.1 / 0.15: 0.849 / 0.896
# against 0.862 / 0.883 (single-call samples there: ~+-2 %). GPU-tested through the op (tests/test_gpu_cutedsl.py:
# LSE, fp16, D 64, ragged counts, more and fewer groups than SMs) and on grids of 1-500 CTAs. "prefetch" in round
# s6r2 (the op with it, side by side): a tie (0.807 / 0.795 / 0.866 / 0.872 and 0.833 / 0.857 / 0.870 / 0.918 against
# 0.823 / 0.789 / 0.881 / 0.871 and 0.825 / 0.865 / 0.870 / 0.915): not taken. + "hide_epi" (the output's global
# stores under the next group's first MMAs) and "split_tail" (the last, partial round's groups split into key-tile
# parts, merged by tail_merge.py) since 2026-12-01 19:10: H200 round s7r2 (method of record, 4 rounds, side by side;
# 1.3B 480p then 14B 720p, s = 0.1 / 0.15 / 0.25 / 0.5) 0.803 / 0.843 / 0.902 / 0.918 and 0.858 / 0.887 / 0.889 /
# 0.926 against the previous default's 0.793 / 0.823 / 0.890 / 0.874 and 0.826 / 0.850 / 0.881 / 0.912 (better at
# all 8 points) and hide_epi alone 0.801 / 0.841 / 0.887 / 0.899 and 0.853 / 0.896 / 0.892 / 0.932; GPU-tested
# through the op in every dtype / head dim with the LSE, split last rounds with ragged counts. + "pdl" (the op's
# three launches as programmatic dependent launches) and "v3" (3 V stages) since 2026-12-01 22:30: H200 round s8r2
# (method of record, 6 rounds, side by side; 1.3B 480p then 14B 720p, s = 0.1 / 0.15 / 0.25 / 0.5) 0.917 / 0.910 /
# 0.970 / 0.976 and 0.880 / 0.911 / 0.929 / 0.940 against the previous default's 0.869 / 0.883 / 0.944 / 0.957 and
# 0.866 / 0.902 / 0.909 / 0.922 (better at all 8 points; v3 alone 0.914 / 0.908 / 0.985 / 0.995 and 0.877 / 0.913 /
# 0.914 / 0.937); GPU-tested through the op (bf16 D 128 / fp16 D 64 ragged with the LSE, groups vs SMs, split last
# rounds of 138 / 140 groups, three calls queued without a sync, each reading what the launch before it wrote).
# + "q_ahead", "cnt_ahead", "idx_ahead" (the next work item's queries, count and first kv_idx entries loaded during
# this item) and "lazy_rescale" (the running max raised only past +8 in log2 units, O's rescale skipped per warp when
# no row moved) since 2026-12-02 01:15: H200 round s9r1 (method of record with lead-in, 6 rounds, side by side; 1.3B
# 480p then 14B 720p, s = 0.1 / 0.15 / 0.25 / 0.5) 0.902 / 0.914 / 0.967 / 0.982 and 0.892 / 0.933 / 0.918 / 0.927
# against the previous default's 0.879 / 0.902 / 0.957 / 0.960 and 0.849 / 0.895 / 0.903 / 0.915 (better at all 8
# points; the three loads-ahead options alone: no gain); round s9r2 (another H200, 5 rounds) 0.826 / 0.833 / 0.836 /
# 0.877 and 0.884 / 0.915 / 0.886 / 0.926 against 0.826 / 0.806 / 0.864 / 0.861 and 0.873 / 0.901 / 0.891 / 0.909
# (min 0.826 vs 0.806; lazy_rescale without the loads ahead 0.832 / 0.821 / 0.864 / 0.867 and 0.866 / 0.913 / 0.880 /
# 0.944, min 0.821). GPU-tested through the op (split last rounds, the pdl chain, keys ramped so that rows rescale
# mid-walk, overlap grids of 1-500 CTAs).
# + "idx_l2" (the producer's kv_idx lines prefetched into L2 a few key tiles and one work item ahead, the next
# item's count loaded at the item's start, each tile's index waited for after its K stage is free) since 2026-12-02
# 04:30: H200 round s10r2 (method of record with lead-in, 5 rounds, side by side; 1.3B 480p then 14B 720p, s = 0.1 /
# 0.15 / 0.25 / 0.5) 0.903 / 0.931 / 0.999 / 1.014 and 0.930 / 1.001 / 0.947 / 0.919 against the previous default's
# 0.845 / 0.892 / 0.989 / 0.980 and 0.911 / 0.998 / 0.922 / 0.894 (better at all 8 points; 1.015 against 1.085 ms at
# 1.3B s = 0.1); the same kernel without its K/V copies ("diag_no_copy") 0.927 / 0.930 / 1.002 / 1.034 and 1.003 /
# 1.078 / 1.110 / 1.173. GPU-tested through the op (split last rounds, the pdl chain, ramped keys, grids of 1-500
# CTAs). Final round s10final (another H200, 5 rounds): 0.866 / 0.884 / 0.877 / 0.951 and 0.876 / 0.908 / 0.908 /
# 0.918 against the previous default's 0.867 / 0.889 / 0.868 / 0.934 and 0.848 / 0.904 / 0.896 / 0.930 (min 0.866
# against 0.848; level at 1.3B s = 0.1 there).
# + "stage_under_qk" (at a group boundary the finished group's output normalised and staged under the next group's
# second Q K^T, its row sums and the next group's tile count under the boundary's MMAs) since 2026-12-02 07:05: H200
# round s11r2 (method of record with lead-in, 5 rounds, side by side; 1.3B 480p then 14B 720p, s = 0.1 / 0.15 / 0.25
# / 0.5) 0.883 / 0.921 / 0.963 / 1.006 and 0.899 / 0.936 / 0.925 / 0.938 against the previous default's 0.881 / 0.916
# / 0.959 / 0.999 and 0.878 / 0.933 / 0.914 / 0.921 (better at all 8 points, by 0.002-0.021); GPU-tested through the
# op in that round (split last rounds, the pdl chain, ramped keys, grids of 1-500 CTAs). The SM clock stamps of
# the kernel alone (tests/diag_cutedsl_stamps.py, same round) showed no fewer cycles per group with it (70.3k against
# 69.1k at 1.3B s = 0.1): the race's gain is under the H200's power cap, not in cycles. Final round s11final
# (another race, 5 rounds): 0.887 / 0.929 / 0.949 / 0.975 and 0.878 / 0.907 / 0.926 / 0.932 against the previous
# default's 0.910 / 0.940 / 0.963 / 0.998 and 0.912 / 0.926 / 0.902 / 0.913 (behind at 6 of 8): both rounds' margins
# are inside the race's spread; kept as measured (no change after a final round), to be raced again. Raced again in
# round s12r1 (another H200, 4 rounds): 0.830 / 0.858 / 0.875 / 0.916 and 0.882 / 0.916 / 0.904 / 0.932 against
# 0.804 / 0.844 / 0.859 / 0.900 and 0.894 / 0.931 / 0.893 / 0.929 without it (ahead at 6 of 8, min 0.830 against
# 0.804): kept.
# "pad2" (the consumers' code moved by ~4 KiB of instruction addresses: 96 clock reads at their start, nothing
# else changed) was in it from 2026-12-02 10:10 to 12:30 (removed: not confirmed in two more races): H200 round s12r3 (method of record with lead-in, 4 rounds, side by side,
# 1.3B 480p s = 0.1 / 0.25 / 0.5) 0.939 / 1.021 / 1.030 against the default's 0.911 / 0.985 / 0.979 and "pad1" (~1.1
# KiB) 0.891 / 0.954 / 0.967: the same instructions run 3-5 % faster or 2.5 % slower by where the consumers' code
# sits (offline sm_90a SASS, the consumers' key-tile loop at 0x8e90 / 0x92d0 / 0x9e10, the producer's at 0x2e50 in
# all three; the mechanism, an instruction-fetch effect, is not identified: the two loops' overlap modulo 16 / 32
# KiB predicts the opposite order). Any edit of the kernel moves its code: race the default against itself with
# another pad before reading a small difference (docs/kernels.md, session 12).
# Final round s12final (both shapes, 5 rounds): 0.895 / 0.908 / 0.961 / 0.978 and 0.890 / 0.920 / 0.920 / 0.936
# against 0.880 / 0.932 / 1.027 / 0.987 and 0.890 / 0.931 / 0.908 / 0.928 without pad2 (ahead at 3, level at 1, behind
# at 4; min 0.890 against 0.880). Session 13 (balanced order, both shapes): round s13r1 (12 / 6 rounds) 0.895 / 0.908 /
# 0.949 / 0.980 | 0.878 / 0.911 / 0.913 / 0.951 and, the same call again, 0.877 / 0.912 / 0.932 / 0.950 | 0.886 /
# 0.892 / 0.924 / 0.935 against 0.876 / 0.897 / 0.935 / 0.958 | 0.874 / 0.882 / 0.920 / 0.948 without pad2 (ahead
# at 7 of 8 by less than the two identical rows differ, up to 0.031); round s13r2 (12 / 6 rounds) 0.885 / 0.902 /
# 0.951 / 0.981 | 0.850 / 0.918 / 0.906 / 0.920 against 0.874 / 0.899 / 0.954 / 0.976 | 0.858 / 0.904 / 0.903 / 0.921
# (ahead at 4, behind at 3, level at 1): the placement effect of s12r3 did not repeat; removed, with the test that
# pinned its loops' addresses.
STAGED_OPTIONS: tuple = ("persistent", "overlap", "hide_epi", "split_tail", "pdl", "v3", "q_ahead", "cnt_ahead",
                         "idx_ahead", "lazy_rescale", "idx_l2", "stage_under_qk")
# compile options of the register-epilogue kernel (calls with a residual: the reuse path's), as STAGED_OPTIONS:
# persistent + overlap since 2026-12-01 16:40: H200 round s6r2 (method of record, 4 rounds, side by side, plain bf16
# residual, no LSE; 1.3B 480p then 14B 720p, s = 0.1 / 0.15 / 0.25 / 0.5) 0.772 / 0.757 / 0.856 / 0.878 and 0.834 /
# 0.843 / 0.863 / 0.901 against one CTA per group 0.728 / 0.736 / 0.840 / 0.854 and 0.792 / 0.838 / 0.846 / 0.904;
# each checked in the same run; GPU tests with plain and int4_group residuals on grids of 1, 7 and 500 CTAs.
# + pdl, v3, q_ahead, cnt_ahead, idx_ahead, lazy_rescale, idx_l2 since 2026-12-02 06:25: round s10final (side by
# side) 0.804 / 0.832 / 0.813 / 0.905 and 0.837 / 0.880 / 0.843 / 0.890 against persistent + overlap's 0.770 / 0.818
# / 0.784 / 0.886 and 0.816 / 0.865 / 0.856 / 0.901; round s11r1 (method of record with lead-in, 5 rounds, side by
# side, plain bf16 residual) 0.833 / 0.867 / 0.917 / 0.950 and 0.843 / 0.875 / 0.884 / 0.864 against 0.805 / 0.809 /
# 0.883 / 0.891 and 0.825 / 0.886 / 0.870 / 0.865 (better at 6 of 8 points, level at the other two; min 0.833 vs
# 0.805); GPU-tested through the op in that round (plain and int4_group residuals on 68 and 544 groups, the pdl
# chain with a plain residual: test_cutedsl_env_res_candidate).
REGISTERS_OPTIONS: tuple = ("persistent", "overlap", "pdl", "v3", "q_ahead", "cnt_ahead", "idx_ahead", "lazy_rescale",
                            "idx_l2")


def refusal(device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot run on this device / dtype / head dim (None when it can)."""
    if device_type != "cuda":
        return f"runs on CUDA devices, got {device_type}"
    if dtype not in DTYPE_NAMES:
        return f"runs float16/bfloat16 only, got {dtype}"
    if capability is None or capability[0] != 9:
        return f"is built for sm_90 (Hopper), got compute capability {capability}"
    if head_dim not in HEAD_DIMS:
        return f"runs head dim 64 or 128, got {head_dim}"
    return None


def refuse(op: str, q: torch.Tensor, requested: bool) -> str | None:
    """The registry's rule (``kernels/registry.py``): why this backend cannot run ``op`` on ``q``."""
    if op != "sparse_attention":
        return f"implements sparse_attention only, not {op}"
    cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
    return refusal(q.device.type, cap, q.dtype, q.shape[-1])


def call_refusal(q, k, v, perm, kv_idx, *, out=None, residual=None) -> str | None:
    """Why one call cannot run on the kernel though the backend accepted q (None when it can): group size, group
    count, the rows of q / k / v (16-byte copies), of ``out`` (4-byte stores), of the residual (pairs of elements)
    and its per-row tensors (unit stride on S). Checked on shapes and strides only (no device sync)."""
    B, H, _, _ = q.shape
    G = kv_idx.shape[2]
    C = perm.shape[-1] // G
    if C != GROUP_SIZE:
        return f"needs group size {GROUP_SIZE} (one query tile), got {C}"
    if B * H * G >= 2**31:
        return f"runs fewer than 2^31 groups, got {B * H * G}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        why = _rows(t.transpose(1, 2), 16)
        if why:
            return f"reads {name} rows by 16-byte copies: {why}"
    if out is not None:
        why = _rows(out.transpose(1, 2), 4)
        if why:
            return f"writes out rows 4 bytes at a time: {why}"
    if residual is not None:
        data = residual.data.view(torch.uint8) if residual.kind == "fp8_row" else residual.data
        why = _rows(data.transpose(1, 2), 1 if residual.kind.startswith("int4") else 2 * data.element_size())
        if why:
            return f"reads residual rows in pairs: {why}"
        for name, t in (("scale", residual.scale), ("coef", residual.coef)):
            if t is not None and t.stride(-1) != 1:
                return f"reads the residual {name} with unit stride on S, got strides {tuple(t.stride())}"
        if residual.mean is not None:
            why = _rows(residual.mean, 4)
            if why:
                return f"reads the residual's group mean rows in pairs: {why}"
    return None


def _rows(t: torch.Tensor, align: int) -> str | None:
    """Why rows of t (``(B, S, H, D)``; the last dim must have unit stride) are not ``align``-byte aligned."""
    step = max(1, align // t.element_size())
    if t.stride(-1) != 1 or t.data_ptr() % align or any(s % step for s in t.stride()[:-1]):
        return f"unit stride on D and {align}-byte aligned rows needed, got strides {tuple(t.stride())}"
    return None


def epilogue_for(residual: str, out: torch.Tensor) -> str:
    """The kernel epilogue a call runs (a compile-time choice): ``EPILOGUE`` when it is the staged one ("smem") only
    without a residual (``residual`` is compile.py's residual key, "none") and with out's base and row strides
    16-byte aligned (its 16-byte stores), else "registers" (4-byte stores, residual added before rounding)."""
    aligned = out.data_ptr() % 16 == 0 and all(st * out.element_size() % 16 == 0 for st in out.stride()[:3])
    return EPILOGUE if residual == "none" and aligned else "registers"


def launch_plan(epilogue: str, groups: int, sms: int) -> tuple[tuple, int]:
    """(compile options, CTA count) of a call whose kernel runs ``epilogue`` over ``groups`` query groups on a device
    of ``sms`` SMs: the staged epilogue takes ``STAGED_OPTIONS``, the register epilogue ``REGISTERS_OPTIONS``; with
    "persistent" among them a grid of min(sms, groups) CTAs walks the groups, otherwise one CTA per group."""
    options = staged_options() if epilogue == "smem" else registers_options()
    return options, min(sms, groups) if "persistent" in options else groups


MAX_PARTS = 16  # "split_tail": the most parts a group of the last round is split into


def split_parts(groups: int, ctas: int) -> int:
    """Parts per group of the persistent walk's last round for the "split_tail" option (1: no split): with ``groups``
    over ``ctas`` CTAs the last round holds r = groups mod ctas groups; split when 0 < r <= ctas / 2 (a fuller round
    gains little) into min(ctas // r, ``MAX_PARTS``) parts, so the round's items fill the CTAs about once. Needs more
    groups than CTAs (the kernel's grid is then ``ctas``)."""
    r = groups % ctas if groups > ctas else 0
    return min(ctas // r, MAX_PARTS) if 0 < r <= ctas // 2 else 1


def staged_options() -> tuple:
    """The staged-epilogue kernel's compile options: ``STAGED_OPTIONS``, or ``$MC_SPARSE_CUTEDSL_OPTIONS`` (comma-
    separated ``sparse_fwd_sm90.OPTIONS``, e.g. "persistent"; "none" for none) to time or try
    another set. An unknown name fails the call's compile with a ValueError (the op's fallback, with the reason)."""
    return _options("MC_SPARSE_CUTEDSL_OPTIONS", STAGED_OPTIONS)


def registers_options() -> tuple:
    """The register-epilogue kernel's compile options (calls with a residual): ``REGISTERS_OPTIONS``, or
    ``$MC_SPARSE_CUTEDSL_RES_OPTIONS`` (as ``staged_options``)."""
    return _options("MC_SPARSE_CUTEDSL_RES_OPTIONS", REGISTERS_OPTIONS)


def _options(env: str, default: tuple) -> tuple:
    raw = os.environ.get(env)
    if raw is None:
        return tuple(default)
    return tuple(o for o in (x.strip() for x in raw.split(",")) if o and o != "none")
