"""The package's public names, imported together the first time one is asked for
(``cudagraph_rt.__getattr__``): ``import cudagraph_rt`` alone imports no torch. Every name
here is re-exported (``cudagraph_rt.__all__`` lists them)."""
from __future__ import annotations

from .digest import StateDigest
from .errors import (
    BusyError,
    CapacityError,
    CaptureError,
    CgrtError,
    DeviceRowIndexError,
    InputError,
    StaleCaptureError,
    StaleRowsError,
    StepFunctionError,
)
from .graphs import Graphs
from .graphs.capture import CaptureReport, WidthCapture
from .host_rows import HostRows, HostRowsHandle
from .pieces import eager, step_values
from .runtime import GraphRuntime, RuntimeStats, StepResult
from .inputs.spec import InputSpec
from .sampling_params import SamplingParams
from .widths import Slice, default_widths, plan_step
