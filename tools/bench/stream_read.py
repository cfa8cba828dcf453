"""A plain streaming read for bench.attention's ``ceiling`` section: ``stream_read`` loads
``n`` elements, BLOCK per program, and stores only those equal to ``never`` (none, for a
value outside the data), so the loads are kept and nothing is written. Imported at first
use, after the bench has chosen the interpreter or the GPU (Triton fixes it when the
kernel is defined)."""
import triton
import triton.language as tl


@triton.jit
def stream_read(x_ptr, out_ptr, n, never, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + off, mask=off < n, other=0.0)
    tl.store(out_ptr + off, x, mask=(off < n) & (x == never))
