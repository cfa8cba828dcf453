"""One-off H200 experiments whose figures BENCHMARKS.md records (run F on): each script
says what it measures and how it is run. Not part of ``cgrt bench``; the variants that
need a branch's kernel (the K/V write in the attention launch, branch ``fused-write``)
are skipped where this tree lacks it."""
