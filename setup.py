"""The package layout; the metadata and dependencies are in pyproject.toml.

kernels/ and tools/ are top-level folders of the repository but install under the package
(cudagraph_rt.kernels, cudagraph_rt.tools), so nothing claims a global module named
`kernels` or `tools`. The mapping is the packaging's alone: run the tree as an editable
install (`pip install --no-deps --no-build-isolation -e .` works offline).
"""
from setuptools import setup

setup(
    packages=[
        "cudagraph_rt",
        "cudagraph_rt.debug",
        "cudagraph_rt.graphs",
        "cudagraph_rt.dispatch",
        "cudagraph_rt.host_rows",
        "cudagraph_rt.inputs",
        "cudagraph_rt.models",
        "cudagraph_rt.speculative",
        "cudagraph_rt.sweep",
        "cudagraph_rt.kernels",
        "cudagraph_rt.kernels.attention",
        "cudagraph_rt.kernels.row_gather",
        "cudagraph_rt.kernels.sampling",
        "cudagraph_rt.tools",
        "cudagraph_rt.tools.bench",
        "cudagraph_rt.tools.bench.experiments",
        "cudagraph_rt.tools.demo",
        "cudagraph_rt.tools.sweep",
    ],
    package_dir={
        "cudagraph_rt": "cudagraph_rt",
        "cudagraph_rt.kernels": "kernels",
        "cudagraph_rt.tools": "tools",
    },
)
