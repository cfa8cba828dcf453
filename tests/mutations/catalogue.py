"""The mutation catalogue: realistic one-line bugs, each planted by ``run.py`` in a scratch
copy of the tree (never in the working tree) and run against the CPU suite.

An entry names the file, the ORIGINAL line (compared with its indentation stripped; it must
occur exactly once in the file, or exactly once after ``anchor`` where the same line occurs
twice), the MUTATED line (written with the original's indentation; ``pass`` deletes a
statement), the area it belongs to, why a developer could write it, and the test files to
run first (``tests``: the concept's own tests; the whole suite runs when they all pass).
``graph_path``: the code runs only on the graph path (fed graphs, the short path, handed
views, static outputs, emulated replay): graphs off never executes it.

tests/properties/test_mutation_catalogue.py checks that every entry still applies to HEAD; a change
to a planted line must update its entry here (or drop it, saying why in the commit).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    id: int
    area: str
    file: str
    original: str
    mutated: str
    why: str
    tests: tuple[str, ...]
    graph_path: bool = False
    anchor: str | None = None  # a unique line before the target, when the target line is not unique


PLANNER = ("tests/core/test_widths.py", "tests/tools/test_sweep.py")
# the bad-input catalogue's cases live in the concept files they check: inputs, construction
# and the step function's output (runtime), widths, host-row choices and commit (host_rows)
INPUTS = ("tests/core/test_inputs.py", "tests/core/test_runtime.py", "tests/core/test_widths.py",
          "tests/core/test_host_rows.py")
FEED = ("tests/core/test_staging.py", "tests/core/test_emulated_graphs.py", "tests/core/test_direct_step.py")
SHORT = ("tests/core/test_direct_step.py", "tests/core/test_emulated_graphs.py")
ROWS = ("tests/core/test_host_rows.py", "tests/core/test_emulated_graphs.py")
GATHER = ("tests/kernels/test_row_gather.py",)
CAPTURE = ("tests/core/test_emulated_graphs.py", "tests/core/test_lifecycle.py", "tests/core/test_runtime.py")
TP = ("tests/models/test_tp.py",)
SWEEP = ("tests/tools/test_sweep.py", "tests/properties/test_planted_bugs.py")
ACCEPT = ("tests/runner/test_runner_contract.py",)
HF = ("tests/models/test_hf.py",)
POOL = ("tests/models/test_pool.py",)
ATTN = ("tests/kernels/test_cell_attention.py",)
ROTARY = ("tests/kernels/test_rotary_cells.py", "tests/models/test_hf_rotary.py")
PDL = ("tests/kernels/test_dependent_launch_order.py",)
BENCH = ("tests/tools/test_bench.py", "tests/tools/test_bench_timing.py", "tests/tools/test_bench_attention.py")
RUNNER = ("tests/runner/test_runner_contract.py", "tests/runner/test_fuzz_runner.py")
BOUND = ("tests/core/test_bound_calls.py",)
MARKED = ("tests/core/test_pieces.py", "tests/properties/test_fuzz_marked_calls.py")
OUTPUTS = ("tests/core/test_host_rows.py",)
ARGS = ("tests/properties/test_bad_arguments.py",)  # the bad-argument fuzz (issue 35)
CLI = ("tests/tools/test_cli.py",)
SAMPLING = ("tests/kernels/test_sampling.py", "tests/properties/test_sampling_contract.py")

M = Mutation
CATALOGUE: tuple[Mutation, ...] = (
    # ---------------------------------------------------------------- the planner
    M(1, "planner", "cudagraph_rt/widths.py",
      'return Slice("graph", widths[bisect.bisect_left(widths, left)], start, left)',
      'return Slice("graph", widths[bisect.bisect_right(widths, left)], start, left)',
      "bisect_right for bisect_left: a T equal to a width pads to the next one (or past the widest)", PLANNER),
    M(2, "planner", "cudagraph_rt/widths.py",
      "while w < max_width:",
      "while w <= max_width:",
      "`<=` for `<`: a power-of-two max_width is listed twice", PLANNER),
    # ---------------------------------------------------------------- input checks
    M(3, "input checks", "cudagraph_rt/inputs/validate.py",
      "if type(t) is not torch.Tensor or t.dtype is not dtype or not t.is_cpu or t.is_neg() \\",
      "if type(t) is not torch.Tensor or t.dtype is not dtype or not t.is_cpu \\",
      "the short path's fast check drops is_neg(): a lazy negation's bytes are memmoved with the other sign",
      INPUTS + SHORT, graph_path=True),
    M(4, "input checks", "cudagraph_rt/inputs/casting.py",
      "if big > lim:",
      "if big >= lim:",
      "`>=` for `>`: 2**24 (exact in float32) is refused for a float32 input", INPUTS),
    M(5, "input checks", "cudagraph_rt/inputs/casting.py",
      "out = torch.from_numpy(_float32_round_to_odd(a)).to(torch.bfloat16)",
      "out = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)",
      "the 'simpler' double rounding float64 -> float32 -> bfloat16 (1 ulp off now and then)", INPUTS),
    M(6, "input checks", "cudagraph_rt/inputs/casting.py",
      'value = value.astype(value.dtype.newbyteorder("="))  # exact: same values',
      'value = value.view(value.dtype.newbyteorder("="))',
      "view for astype: a big-endian array's bytes are reinterpreted, not converted", INPUTS),
    M(7, "input checks", "cudagraph_rt/inputs/casting.py",
      "if t.numel() == 0 or (int(t.min()) >= info.min and int(t.max()) <= info.max):",
      "if t.numel() == 0 or int(t.max()) <= info.max:",
      "only the upper bound checked before narrowing: values below the dtype's min wrap", INPUTS),
    # ---------------------------------------------------------------- staging and the feed
    M(8, "staging", "cudagraph_rt/inputs/staging.py",
      "self._full[name][length:width].fill_(pads[name].pad)",
      "self._full[name][length + 1:width].fill_(pads[name].pad)",
      "off by one: the first padding row keeps the last step's row (graphs off on a CPU)", FEED + SWEEP),
    M(9, "staging", "cudagraph_rt/inputs/staging.py",
      "dst_np[:length] = t.detach().numpy()[start:start + length]",
      "dst_np[:length] = t.detach().numpy()[:length]",
      "the slice's start forgotten where rows are cast: every slice of a sliced step gets the first slice's rows",
      FEED + INPUTS),
    M(10, "feed", "cudagraph_rt/inputs/feed.py",
      "pad = self._row_of_byte >= self._mirror_t  # rows [T, ...) of every input",
      "pad = self._row_of_byte > self._mirror_t  # rows [T, ...) of every input",
      "`>` for `>=`: the prologue leaves row T (the first padding row) as the feed held it", FEED, graph_path=True),
    M(11, "feed", "cudagraph_rt/inputs/feed.py",
      "flags_np[i] = flags[i] = True",
      "flags[i] = True",
      "the host copy of an input's flag set, the feed's own byte (what the graph reads) not", FEED + SWEEP,
      graph_path=True),
    M(12, "feed", "cudagraph_rt/inputs/__init__.py",
      "self._handed_host = None  # used up (see consume)",
      "pass  # used up (see consume)",
      "a write through a stager (a fed graph's into the feed, as every other) does not use up the handed "
      "views: kept views are taken again",
      ("tests/core/test_inputs.py",) + FEED, graph_path=True,
      anchor="def write_via(self, stager: Stager, prep: Prepared, start: int, length: int, width: int,"),
    # ---------------------------------------------------------------- the short path
    M(13, "short path", "cudagraph_rt/direct_step.py",
      "return StepResult(e.cut.copy() if e.is_dict else e.cut, T, e.slices, None, None, self._token)",
      "return StepResult(e.cut, T, e.slices, None, None, self._token)",
      "the cached cut dict handed out itself: a caller's edit of res.outputs changes later steps' outputs",
      SHORT, graph_path=True),
    M(14, "short path", "cudagraph_rt/direct_step.py",
      "e.replay()",
      "e.replay.__self__.launch()",
      "the short path launches the graph itself, past the executor's replay: its replays go uncounted",
      SHORT + SWEEP, graph_path=True),
    M(15, "short path", "cudagraph_rt/direct_step.py",
      "self._inputs.consume()",
      "pass",
      "the short path does not use up the handed views: views kept past their step are accepted",
      SHORT + ("tests/core/test_inputs.py",), graph_path=True),
    # ---------------------------------------------------------------- handed views, static outputs
    M(16, "handed views", "cudagraph_rt/runtime.py",
      "self._inputs.unfeed()",
      "pass",
      "static_inputs() without unfeed: a replay by hand copies the feed over the rows the caller wrote",
      CAPTURE, graph_path=True),
    M(17, "static outputs", "cudagraph_rt/host_rows/device_chosen.py",
      "return (start, width, length, r.reshape(-1)[:width].to(torch.int64, copy=True),",
      "return (start, width, length, r.reshape(-1)[:width].to(torch.int64),",
      "the slice record keeps an int64 chooser's static output, which the next slice's replay rewrites",
      ROWS, graph_path=True),
    # ---------------------------------------------------------------- host-row choices and snapshots
    M(18, "host rows", "cudagraph_rt/host_rows/device_chosen.py",
      "pad = used & (rows >= c.T) & (rows < n)",
      "pad = used & (rows > c.T) & (rows < n)",
      "`>` for `>=`: a chosen row T (the first padding row) is shipped", ROWS),
    M(19, "host rows", "cudagraph_rt/host_rows/device_chosen.py",
      "ok = used & (r >= 0) & (r < length)  # rows [length, width) are padding: dropped",
      "ok = used & (r >= 0) & (r < width)  # rows [length, width) are padding: dropped",
      "width for length: a sliced step ships a slice's chosen padding rows (as the next slice's rows)", ROWS),
    M(20, "snapshots", "cudagraph_rt/host_rows/commit_chosen.py",
      "if self._gen[snap_slot] != gen:",
      "if self._gen[snap_slot] < gen:",
      "`<` for `!=`: a commit of a snapshot reused by a later step is not refused (generations only grow)", ROWS),
    M(21, "host rows", "cudagraph_rt/host_rows/config.py",
      "if lo < 0 or hi >= T:",
      "if lo < 0 or hi > T:",
      "`>` for `>=`: rows=[T] is accepted and ships a padding row", ROWS + INPUTS),
    M(22, "host rows", "cudagraph_rt/host_rows/ring.py",
      "self._gen[slot] -= 1",
      "pass",
      "a failed step gives its ring slot back without its generation: the ring is not as before the step",
      ROWS + ("tests/core/test_inputs.py",)),
    # ---------------------------------------------------------------- the row gather
    M(23, "row gather", "kernels/row_gather/reference.py",
      "n = min(max(c, 0), C, R)",
      "n = min(c, C, R)",
      "the reference forgets to clamp a negative count", GATHER),
    M(24, "row gather", "kernels/row_gather/kernel.py",
      "bad = ((count > C).to(tl.int32) * 2 + ((count < 0) | (count > R)).to(tl.int32) * 4",
      "bad = ((count >= C).to(tl.int32) * 2 + ((count < 0) | (count > R)).to(tl.int32) * 4",
      "the kernel flags a count equal to the slot's capacity", GATHER),
    M(25, "row gather", "kernels/row_gather/launch.py",
      "grid = (max(1, -(-cap // rows_pp)), -(-H // block_h))",
      "grid = (max(1, cap // rows_pp), -(-H // block_h))",
      "floor for ceiling division: the last partial block of rows is never copied", GATHER),
    M(26, "row gather", "kernels/row_gather/launch.py",
      "while vec > 1 and (H % vec or any(st % vec for st in strides)):",
      "while vec > 1 and H % vec:",
      "the vector width checked against H only: a false alignment hint for padded strides (GPU loads)", GATHER),
    # ---------------------------------------------------------------- capture
    M(27, "capture", "cudagraph_rt/graphs/emulation.py",
      "for _ in range(st.warmup):",
      "for _ in range(st.warmup - 1):",
      "one warm-up run short under emulation (step_fn_calls and stateful step functions see it)", CAPTURE),
    M(28, "capture", "cudagraph_rt/graphs/capture.py",
      "return None if self._watch is None else [(t.data_ptr(), tuple(t.shape)) for t in self._watch()]",
      "return None if self._watch is None else [t.data_ptr() for t in self._watch()]",
      "watch() remembers addresses only: a watched tensor resized in place is not seen", CAPTURE),
    # ---------------------------------------------------------------- distributed checks
    M(29, "distributed", "cudagraph_rt/distributed.py",
      "pad = torch.full((to - T, *spec.shape), spec.pad, dtype=spec.dtype, device=t.device)",
      "pad = torch.full((to - T, *spec.shape), 0, dtype=spec.dtype, device=t.device)",
      "agree_width pads with zeros instead of each input's pad (cell 0 is a live cell)", TP),
    M(30, "distributed", "cudagraph_rt/distributed.py",
      "self.ships = rows_rank is None or rows_rank == self.rank",
      "self.ships = rows_rank == self.rank",
      "rows_rank=None ('every rank ships') forgotten: no rank ships host rows", TP),
    # ---------------------------------------------------------------- the sweep harness
    M(31, "sweep harness", "cudagraph_rt/testing/checks.py",
      "err = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))",
      "err = torch.nan_to_num(err, nan=0.0)",
      "NaN 'cleaned' from the errors: a NaN hidden row passes the tolerance check", SWEEP),
    M(32, "sweep harness", "cudagraph_rt/testing/checks.py",
      'if last.path != "graph" or last.padding <= 0 or last.width not in rt.widths:',
      'if last.path != "graph" or last.padding <= 1 or last.width not in rt.widths:',
      "the pad check skipped for a step with one padding row", SWEEP),
    M(33, "sweep harness", "cudagraph_rt/testing/harness.py",
      "ties = ~counts & (got != exp_tokens)  # differs at a near-tie: counted, not a failure",
      "ties = got != exp_tokens  # differs at a near-tie: counted, not a failure",
      "every differing token counted as a near-tie, not only those at an unclear margin", SWEEP + HF),
    # ---------------------------------------------------------------- the acceptance rule
    M(34, "acceptance", "cudagraph_rt/models/accept.py",
      "earlier = (seq_ids[None, :] == seq_ids[:, None]) & (positions[None, :] < positions[:, None])  # [i, j]: j before i",
      "earlier = (seq_ids[None, :] == seq_ids[:, None]) & (positions[None, :] <= positions[:, None])  # [i, j]: j before i",
      "`<=` for `<`: a mismatching row blocks itself, so the correction row is never committed",
      ACCEPT + ("tests/models/test_toy.py",)),
    # ---------------------------------------------------------------- the transformers adapter
    M(35, "transformers adapter", "cudagraph_rt/models/hf.py",
      "st.cells, d ** -0.5 if scaling is None else scaling, sliding_window)",
      "st.cells, d ** -0.5 if scaling is None else scaling, None)",
      "the layer's sliding window not passed on: sliding layers attend to the whole sequence", HF),
    M(36, "transformers adapter", "cudagraph_rt/models/hf.py",
      "eps = torch.finfo(self.config.dtype).eps",
      "eps = torch.finfo(torch.bfloat16).eps",
      "the margin's eps of the wrong dtype: an fp32 model's clear margins are 2**16 too wide (every token 'unclear')",
      HF + SWEEP),
    M(37, "transformers adapter", "cudagraph_rt/testing/adapter.py",
      "self._watch = (pad, pool.k[:, pad].clone(), pool.v[:, pad].clone())",
      "self._watch = (pad, pool.k[:, pad], pool.v[:, pad])",
      "the watched pad cell kept as views, not copies: a write into it is never seen", SWEEP + HF),
    # ---------------------------------------------------------------- the paged pool
    M(38, "paged pool", "cudagraph_rt/models/pool.py",
      "need = [b for b in range(b0, b1 + 1) if row[b] == self.scratch_block or self._refs[row[b]] > 1]",
      "need = [b for b in range(b0, b1 + 1) if row[b] == self.scratch_block or self._refs[row[b]] > 2]",
      "copy-on-write only past two holders: a block shared by a fork and its source is written in place", POOL),
    M(39, "paged pool", "cudagraph_rt/models/pool.py",
      "live = seq_ids >= 0",
      "live = seq_ids > 0",
      "`>` for `>=`: sequence 0's rows get the scratch cell on the device path", POOL),
    # ---------------------------------------------------------------- the cell attention's reference
    M(40, "cell attention reference", "kernels/attention/reference.py",
      "lo = (pos - window + 1).clamp(min=0) if window is not None else torch.zeros_like(pos)",
      "lo = (pos - window).clamp(min=0) if window is not None else torch.zeros_like(pos)",
      "the sliding window one position wider", ATTN + HF),
    M(41, "cell attention reference", "kernels/attention/reference.py",
      "dist = (pos[:, None] - bias_shift - j[None, :]).abs().float()  # [N, span]",
      "dist = (pos[:, None] + bias_shift - j[None, :]).abs().float()  # [N, span]",
      "the ALiBi shift's sign flipped", ATTN),
    # ---------------------------------------------------------------- the bench statistics
    M(42, "bench statistics", "tools/bench/common.py",
      "xs = sorted(ns)",
      "xs = list(ns)",
      "percentiles read off the unsorted samples", BENCH),
    M(43, "bench statistics", "tools/bench/report.py",
      'hi, lo = max(s["max"] for s in sp.values()), max(s["min"] for s in sp.values())',
      'hi, lo = max(s["max"] for s in sp.values()), min(s["min"] for s in sp.values())',
      "the best case's least repeat for the worst case's: a width wholly over the limit reads 'unclear', not missed",
      BENCH),
    M(44, "bench statistics", "tools/bench/attention.py",
      "live = cells * shape.Hkv * shape.D * torch.finfo(shape.dtype).bits // 8 * 2",
      "live = cells * shape.Hkv * shape.D * torch.finfo(shape.dtype).bits // 8",
      "the KV floor counts K only: the floor halves and every kernel looks twice as far from it", BENCH),
    M(45, "bench statistics", "tools/bench/pool.py",
      'if r["live"] >= 8192:',
      'if r["live"] > 8192:',
      "`>` for `>=`: the 8k-cell attention goal is never judged", BENCH),
    # ---------------------------------------------------------------- the runner
    M(46, "runner", "cudagraph_rt/spec/runner.py",
      "ks = [min(self.k, s.max_new - (len(s.tokens) - len(s.prompt)) - 1) for s in dec]  # never past the limit",
      "ks = [min(self.k, s.max_new - (len(s.tokens) - len(s.prompt))) for s in dec]  # never past the limit",
      "drafts one token past max_new", RUNNER),
    M(47, "runner", "cudagraph_rt/spec/runner.py",
      "if owed + self._blocks_for(len(r.prompt), r.max_new) > pool.free_blocks:",
      "if self._blocks_for(len(r.prompt), r.max_new) > pool.free_blocks:",
      "admission forgets what the admitted sequences still owe the pool: a tight pool runs out mid-run",
      RUNNER + POOL),
    M(48, "runner", "cudagraph_rt/spec/drafting.py",
      "x ^= x >> 15",
      "x ^= x >> 16",
      "the host drafter's Python-int hash drifts from mix32: host and device drafters draft differently",
      RUNNER),
    M(49, "runner", "cudagraph_rt/spec/drafting.py",
      "ok = torch.isfinite(c.rows.float()).all(1).numpy()",
      "ok = torch.isfinite(c.rows.float()).any(1).numpy()",
      "any for all: a host row with some NaN entries passes the reference drafter's check", RUNNER),
    # ---------------------------------------------------------------- the stagers (added with inputs/stager.py)
    M(50, "stagers", "cudagraph_rt/executor.py",
      "self.stager = inputs.graph_stager",
      "self.stager = inputs.stager",
      "a graph slice holds the arena stager: its rows go straight into the arena, and a fed graph's "
      "prologue then copies the feed's stale rows over them", FEED + ("tests/core/test_stagers.py",), graph_path=True),
    M(51, "stagers", "cudagraph_rt/inputs/stager.py",
      "if feed_event is None or layout.nbytes > ONE_COPY_BYTES:",
      "if feed_event is None:",
      "the size rule forgotten: a big arena is fed, and every replay copies all of it (bandwidth, not latency)",
      ("tests/core/test_stagers.py",) + FEED, graph_path=True),
    # ---------------------------------------------------------------- bound replays of marked calls
    M(52, "bound replays", "cudagraph_rt/graphs/pieces.py",
      "self._run = bind(*args, **kwargs) if bind is not None else functools.partial(fn, *args, **kwargs)",
      "self._run = functools.partial(fn, *args, **kwargs)",
      "the bind forgotten: replays run the call's host work again (right numbers, none of the saving)",
      BOUND + ("tests/core/test_pieces.py",), graph_path=True),
    M(53, "bound replays", "cudagraph_rt/models/pool.py",
      "window=window, slopes=slopes, bias_shift=bias_shift, out=out)",
      "window=window, slopes=None, bias_shift=bias_shift, out=out)",
      "the bound attention of a CPU pool drops its position bias (the toy's ALiBi-shaped slopes)",
      BOUND + ("tests/core/test_pieces.py",), graph_path=True),
    M(54, "bound replays", "kernels/attention/launch.py",
      "block_size, scale, bias_shift, window)",
      "block_size, scale, bias_shift, None)",
      "the bound attention drops its sliding window: every bound launch attends the whole context",
      BOUND + ATTN),
    # ---------------------------------------------------------------- references and benches
    M(55, "attention reference", "kernels/attention/reference.py",
      "k_cache.index_copy_(0, cells.long(), k.to(k_cache.dtype))  # (index_copy_ takes int64 indices only)",
      "k_cache.index_copy_(0, cells, k.to(k_cache.dtype))  # (index_copy_ takes int64 indices only)",
      "the index passed as given: int32 cells, which the contract allows, fail on the CPU path", ATTN),
    M(56, "bench statistics", "tools/bench/attention.py",
      'if device.type == "cpu" and triton_backend() != "interpreter":',
      'if False:',
      "the interpreter check dropped: --quick started without TRITON_INTERPRET fails in every kernel "
      "and still exits 0", BENCH),
    M(57, "attention kernel", "kernels/attention/kernel.py",
      "m, l, acc = _group_only(pos_g >= 0, m_k, l_k, acc_k, m, l, acc)",
      "m, l, acc = m_k, l_k, acc_k",
      "a program serving several groups folds every group's step into all its lanes: the others' "
      "probability 0 hides the wrong cells until one holds a NaN", ATTN),
    M(58, "bench statistics", "tools/bench/hf.py",
      'plans = r.pop("finished_seqs")',
      'r.pop("finished_seqs")',
      "the spec section's plan passes chained to nothing: the timed run plans by eager generate() "
      "again (the realized acceptance falls below the nominal one on near-ties)", HF),
    M(59, "sweep harness", "cudagraph_rt/testing/adapter.py",
      "model.compile_decoder(compile)",
      "pass",
      "cgrt sweep --compile accepted and ignored: the sweep passes on the eager step it always ran",
      ("tests/models/test_compiled_step.py",)),
    M(60, "attention reference", "kernels/attention/reference.py",
      "v = torch.where(visible[:, :, None, None], v, 0)",
      "pass",
      "the reference multiplies probability 0 by every cell of the row's table: a NaN in a stale cell "
      "past the row's position spoils it (the models' CPU path runs the reference)", ATTN),
    M(61, "rotary kernel", "kernels/rotary_cells.py",
      "tl.store(to + H2, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=mask)",
      "tl.store(to + H2, (x2 * c2 - x1 * s2).to(dst.dtype.element_ty), mask=mask)",
      "rotate_half's sign on the wrong half: a rotation by the negative angle on one half", ROTARY),
    M(62, "rotary reference", "kernels/rotary_cells.py",
      "rotated = torch.cat((-x32[..., half:], x32[..., :half]), -1)",
      "rotated = torch.cat((x32[..., half:], -x32[..., :half]), -1)",
      "rotate_half written the other way round (the interleaved convention's sign): the CPU path "
      "rotates by the negative angle, the model's tokens drift from transformers'", ROTARY),
    M(63, "transformers adapter", "cudagraph_rt/models/hf_rotary.py",
      "q, k = self.q_norm(q), self.k_norm(k)",
      "pass",
      "Qwen3's q/k norms skipped in the installed forward: the pool attends unnormalised q and k", ROTARY),
    M(64, "transformers adapter", "cudagraph_rt/models/hf_rotary.py",
      "scale=self.scaling, window=_window(self, self._cgrt_window), rotary=(cos[0], sin[0]))",
      "scale=self.scaling, window=None, rotary=(cos[0], sin[0]))",
      "the installed forward drops the family's sliding window: Mistral and Qwen2's sliding layers "
      "attend their whole context", ROTARY + ("tests/models/test_hf.py",)),
    M(65, "attention kernel", "kernels/attention/kernel.py",
      "tl.extra.cuda.gdc_wait()",
      "pass",
      "the dependent attention never waits: it reads q and the caches while the rotation/write "
      "before it still writes them (a race only a GPU would show, now and then)", ATTN + PDL),
    M(66, "rotary kernel", "kernels/rotary_cells.py",
      "tl.extra.cuda.gdc_wait()",
      "tl.extra.cuda.gdc_launch_dependents()",
      "the rotation/write lets the attention start before waiting for its own predecessor: the "
      "attention's early reads of its rows are no longer ordered after that launch", ROTARY + ATTN + PDL),
    M(67, "attention kernel", "kernels/attention/kernel.py",
      "if (j < arrivals) | ((p == 0) & (split == 0)):",
      "if (p == 0) & (split == 0):",
      "the wait kept for the program that stores the padding: the splits with work read q and K/V and "
      "write the scratch while the write before them is still running (the sm_90 PTX text still has "
      "its wait before every store)", PDL),
    # ---------------------------------------------------------------- the README's promises (issue 40)
    M(68, "staging", "cudagraph_rt/inputs/staging.py",
      "one_copy = bool(host) and self.layout.nbytes <= ONE_COPY_BYTES and not zero_copy.intersection(dev)",
      "one_copy = bool(host) and self.layout.nbytes <= ONE_COPY_BYTES",
      "one copy of the whole staging arena whenever some input comes from the host: the pads it holds where a "
      "device input lies are copied over the rows written in place through device_inputs()", FEED),
    M(69, "handed views", "cudagraph_rt/inputs/__init__.py",
      "stager.arenas[k].mark(T)  # the caller may fill rows [:T] and then step with fewer",
      "pass  # the caller may fill rows [:T] and then step with fewer",
      "host_inputs(T) does not mark the rows it hands out: filled and then stepped with fewer rows, those past "
      "the step's T stay in the feed (and the pinned staging copies them into the device arena)", FEED),
    M(70, "lifecycle", "cudagraph_rt/runtime.py",
      "self._row_choice.close()",
      "pass",
      "close() forgets the host-row choice: the ring, its commit snapshots and a chooser's outputs stay with "
      "the runtime object until it goes", ("tests/core/test_lifecycle.py",)),
    M(71, "capture", "cudagraph_rt/graphs/policy.py",
      "capturer.renew()",
      "pass",
      "no fresh stream and pool after a failed capture attempt: later widths are captured on the stream and "
      "into the pool the failure may have spoiled", CAPTURE, graph_path=True),
    M(72, "sweep harness", "cudagraph_rt/testing/harness.py",
      "counts.append(torch.ones(c.length, dtype=torch.bool) if clear is None else (clear[rows] | ~want))",
      "counts.append(torch.ones(c.length, dtype=torch.bool) if clear is None else clear[rows])",
      "near-ties wherever the margin is unclear: a prefill row that returns a token where -1 is due passes as "
      "a near-tie", SWEEP),
    M(73, "sweep harness", "cudagraph_rt/testing/harness.py",
      "counts.append(torch.ones(c.length, dtype=torch.bool) if clear is None else (clear[rows] | ~want))",
      "counts.append(torch.ones(c.length, dtype=torch.bool) if clear is None else (clear[rows].all() | ~want))",
      "a chunk's tokens count only where all its margins are clear: the near-tie of a prefill row (which wants "
      "no token) excuses a wrong token of its chunk's last row", SWEEP),
    # ---------------------------------------------------------------- marked calls (issue 35)
    M(74, "marked calls", "cudagraph_rt/graphs/emulation.py",
      "call.give_back(copied)",
      "pass",
      "the emulated replay runs the call on the capture's tensors and never copies back: the code after "
      "it reads the re-run's own, never written ([1, 1, 1] for [3, 5, 7])", MARKED, graph_path=True),
    M(75, "marked calls", "cudagraph_rt/graphs/pieces.py",
      "if 0 in dst.stride():",
      "if False:",
      "a plain copy_ into an argument made with expand(): a raw RuntimeError at every emulated replay",
      MARKED, graph_path=True),
    M(76, "marked calls", "cudagraph_rt/graphs/pieces.py",
      "_check_outputs(self._static)",
      "pass",
      "a host value a marked call returns is recorded like a tensor: every replay keeps the capture's "
      "value where graphs off uses the live one", MARKED, graph_path=True),
    M(77, "marked calls", "cudagraph_rt/graphs/pieces.py",
      "if now is not was:",
      "if False:",
      "only the arguments' structure and tensor layouts compared: an entry of a list argument replaced "
      "by the call is lost at every replay without a word", MARKED, graph_path=True),
    M(78, "output containers", "cudagraph_rt/host_rows/device_chosen.py",
      "return tree_unflatten(entries, spec)",
      "return type(outputs)(entries)",
      "device-chosen rows rebuild the outputs with the container's constructor: a NamedTuple's refuses a "
      "list (a raw TypeError after the step ran)", OUTPUTS),
    M(79, "output containers", "cudagraph_rt/host_rows/device_chosen.py",
      "if type(outputs) is dict:",
      "if isinstance(outputs, dict):",
      "the plain dict's fast path taken by every mapping: an OrderedDict or a defaultdict of outputs "
      "comes back a plain dict", OUTPUTS),
    # ---------------------------------------------------------------- bad arguments (issue 35)
    M(80, "argument checks", "cudagraph_rt/checks.py",
      "if not torch.cuda.is_available():",
      "if torch.cuda.device_count() < 0:",
      "the shared device check trusts torch.device: 'cuda:0' on a machine without CUDA reaches torch's "
      "AssertionError (KVPool, ToyDecoder, hf.build, GraphRuntime) instead of an InputError naming device",
      POOL + ("tests/core/test_runtime.py",)),
    M(81, "argument checks", "cudagraph_rt/checks.py",
      "if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):",
      "if not isinstance(v, (int, np.integer)):",
      "a bool is an int to isinstance: SpecRunner(k=True) runs with k=1, ToyConfig(taps=(True,)) taps layer 1",
      RUNNER + ("tests/models/test_toy.py",) + ARGS),
    M(82, "argument checks", "cudagraph_rt/checks.py",
      "bad = [t for t in tokens if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]",
      "bad = [t for t in tokens if isinstance(t, (str, type(None)))]",
      "token lists read with int(): reference([1.5, 2]) feeds token 1, a float prompt is served truncated",
      ("tests/models/test_toy.py",) + RUNNER),
    M(83, "handed views", "cudagraph_rt/runtime.py",
      "if isinstance(T, int) and T > self.config.rows:",
      "if isinstance(T, int) and T < 0:",
      "host_inputs(T)'s size check left to the plan: T = 10**9 plans 10**7 slices before the CapacityError "
      "(and here a T past the rows gets its first slice's views)", ("tests/core/test_widths.py",)),
    M(84, "planner", "cudagraph_rt/runtime.py",
      "slices = (self._planner.first(T),) if sliced else self._planner(T)",
      "slices = self._planner(T)",
      "a step plans every slice before the host-row mode refuses its size", ("tests/core/test_host_rows.py",)),
    M(85, "handed views", "cudagraph_rt/runtime.py",
      "e = self._by_width.get(width) if is_int else None",
      "e = self._by_width.get(width)",
      "static_outputs looks the width up as given: [4] raises TypeError, True and 4.0 find widths 1 and 4",
      ("tests/core/test_widths.py",) + ARGS, graph_path=True),
    M(86, "attention kernel", "kernels/attention/checks.py",
      "if k_cache.shape[0] % block_size:  # the kernel reads whole blocks: a partial last one would be skipped",
      "if k_cache.shape[0] < block_size:",
      "a cache ending in a partial block passes: the kernel skips its cells, the reference indexes past it",
      ATTN),
    M(87, "attention kernel", "kernels/attention/checks.py",
      "return isinstance(v, int) and not isinstance(v, bool)",
      "return isinstance(v, int)",
      "window=True / block_size=True taken as 1 by the kernel, its reference and its bind", ATTN + ARGS),
    M(88, "KV pool", "cudagraph_rt/models/pool.py",
      'self.device = resolve_device(device, "KVPool.device")',
      "self.device = torch.device(device)",
      "the pool takes its device as torch reads it: 'gpu' and None raise torch's errors, 'cuda:0' on a CPU "
      "machine an AssertionError, 'meta' builds a pool nothing can step", POOL + ARGS),
    M(89, "spec runner", "cudagraph_rt/spec/runner.py",
      'k = as_int("k", k, 0)',
      "k = int(k)",
      "k read with int(): k=True drafts 1, k=2.5 drafts 2, k='2' drafts 2", RUNNER + ARGS),
    # ---------------------------------------------------------------- the command line
    M(90, "command line", "tools/options.py",
      'fd, probe = tempfile.mkstemp(prefix=".cgrt-probe-", dir=text)',
      'fd, probe = tempfile.mkstemp(prefix=".cgrt-probe-")',
      "the folder's probe file made without dir=: it lands in the temp folder, so a folder nobody can "
      "write (root and /proc) passes the check and the run fails after its work", CLI),
    M(91, "command line", "tools/options.py",
      "os.unlink(text)",
      "pass",
      "the output check forgets to remove the file it created: an empty file is left behind even when "
      "the run never writes it", CLI),
    M(92, "command line", "tools/console.py",
      'raise BrokenPipeError(errno.EPIPE, "the reader of the output closed it")',
      "raise SystemExit(1)",
      "rich's own answer to a closed pipe kept: `cgrt demo | head -1` exits 1, a failed check", CLI),
    M(93, "command line", "cudagraph_rt/cli.py",
      'kwargs.setdefault("allow_abbrev", False)',
      "pass",
      "argparse's default kept: `--rep 1` is taken as `--repeats 1`", CLI),
    M(94, "command line", "cudagraph_rt/testing/graph_modes.py",
      'if graphs == "auto":',
      'if graphs in ("auto", "both"):',
      "`both` taken like `auto` without CUDA (graphs off, a note): what the demo did, while the sweep "
      "refused it", CLI + SWEEP),
    M(95, "command line", "tools/inspect_cmd.py",
      "signature.bind(graphs=True)",
      "pass",
      "--target not checked for taking graphs=: `--target os:getcwd` fails inside the call instead "
      "of as a usage error", ("tests/tools/test_inspect.py",)),
    M(96, "command line", "tools/sweep/__init__.py",
      "inside = [t for t in args.extras if t <= top + 1]",
      "inside = [t for t in args.extras if t < top + 1]",
      "`<` for `<=`: an extra width equal to the widest + 1, which the sweep runs anyway, is accepted", CLI),
    M(97, "command line", "tools/sweep/__init__.py",
      "if args.attention == \"varlen\" and not args.pieces and any(m is not False for m in modes):",
      "if args.attention == \"varlen\" and not args.pieces and any(m is True for m in modes):",
      "varlen without --pieces refused for CUDA graphs only: emulated graphs capture whole too, and fail "
      "after building the model (exit 1)", CLI),
    M(98, "command line", "tools/options.py",
      "if TYPE_CHECKING:",
      "if True:",
      "torch imported with the shared options (for an annotation): every --help and usage error waits "
      "seconds for it", CLI),
    M(99, "sweep", "cudagraph_rt/testing/assertions.py",
      'if n is None and getattr(device, "type", str(device)) == "cpu":',
      'if n is None and device == "cpu":',
      "the adapter's torch.device compared with a string: never equal, so assert_sweep runs on torch's "
      "default thread count on a CPU", SWEEP),
    # ---------------------------------------------------------------- sampling (kernels/sampling)
    M(100, "sampling rng", "kernels/sampling/philox.py",
      "c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0",
      "c0, c1, c2, c3 = hi1 ^ c1 ^ k1, lo1, hi0 ^ c3 ^ k0, lo0",
      "the two key words swapped in a Philox round: still random-looking, no longer Philox4x32 (the "
      "Random123 known answers catch it; uniformity tests would not)", SAMPLING),
    M(101, "sampling rng", "kernels/sampling/philox.py",
      "return (words >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24",
      "return (words >> 8).to(torch.float32) * 2.0**-24",
      "the 'obvious' 24-bit uniform in [0, 1): u = 0 comes once in 2**24 draws and its Gumbel noise is "
      "-inf (and the Triton side still draws the open interval)", SAMPLING),
    M(102, "sampling rng", "kernels/sampling/philox.py",
      "words = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BLOCK])",
      "words = tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), [BLOCK])",
      "the four Philox words interleaved in the natural-looking order: join's last axis is the inner one, "
      "so indices 4c+1 and 4c+2 swap words and the kernels' noise is no longer the torch path's", SAMPLING),
    M(103, "sampling rejection", "kernels/sampling/torch_path.py",
      "residual_noise = gumbel(settings.seed, settings.position, Stream.RESIDUAL, v)",
      "residual_noise = gumbel(settings.seed, settings.position, Stream.DRAFT, v)",
      "the residual draw reuses the draft model's stream: the token replacing a rejected draft is "
      "correlated with the noise that chose the draft", SAMPLING),
    M(104, "sampling filters", "kernels/sampling/torch_path.py",
      "hit = w.cumsum(-1) >= (settings.top_p * w.sum(-1))[:, None]",
      "hit = w.cumsum(-1) >= (settings.top_p * torch.exp(sd - m[:, None]).sum(-1))[:, None]",
      "top-p measured against the whole distribution instead of the renormalised top-k set (the order "
      "of application the reference and vLLM use)", SAMPLING),
    M(105, "sampling rejection", "kernels/sampling/torch_path.py",
      "accept = valid & (u * q_d < p_d)",
      "accept = valid & (u < p_d)",
      "the acceptance test written for one-hot drafts only: with a draft model's q, min(1, p/q) becomes "
      "p, and the emitted tokens follow a mixture of p and q", SAMPLING),
    M(106, "sampling kernel", "kernels/sampling/triton_path.py",
      "ok = tl.where(phase == _SEARCH_K, cnt >= keff, mass >= target) | (j == 0)",
      "ok = tl.where(phase == _SEARCH_K, cnt > keff, mass >= target) | (j == 0)",
      "`>` for `>=` in the top-k search: the threshold lands one distinct value too high, k - 1 tokens kept",
      SAMPLING),
    M(107, "sampling kernel", "kernels/sampling/triton_path.py",
      "_reset_ticket(ticket_ptr + r)",
      "pass",
      "the stats launch's last program leaves its row's ticket raised: the next call's programs never "
      "see themselves last, and no token of that row is written again", SAMPLING,
      anchor="fst_ptr + r * _F_WORDS, HAS_DRAFT, FULL_Q)"),
    M(108, "sampling kernel", "kernels/sampling/triton_path.py",
      "am = tl.where(s > mx, idx, am)",
      "am = tl.where(s >= mx, idx, am)",
      "`>=` in the running argmax: a tie moves the greedy token to the last maximal logit, no longer "
      "greedy_tokens' first", SAMPLING),
    M(109, "sampling checks", "kernels/sampling/settings.py",
      '_first_bad("top_p", p, ~((p > 0) & (p <= 1)), "a value in (0, 1] (1: off)")',
      '_first_bad("top_p", p, ~((p >= 0) & (p <= 1)), "a value in (0, 1] (1: off)")',
      "top_p = 0 let through: an empty nucleus that the kernels resolve to the most probable token, "
      "silently greedy", SAMPLING),
)
