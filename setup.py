from setuptools import setup

setup(
    name="cudagraph_rt",
    version="0.1.0",
    description="Capture an LLM step function once per padded width into CUDA graphs; replay it for any width.",
    python_requires=">=3.10",
    packages=[
        "cudagraph_rt",
        "cudagraph_rt.host_rows",
        "cudagraph_rt.inputs",
        "cudagraph_rt.models",
        "cudagraph_rt.testing",
        "cudagraph_rt.kernels",
        "cudagraph_rt.tools",
    ],
    # kernels/ and tools/ are top-level folders here but install under cudagraph_rt, so
    # nothing claims a global module named `kernels` or `tools`.
    package_dir={
        "cudagraph_rt": "cudagraph_rt",
        "cudagraph_rt.kernels": "kernels",
        "cudagraph_rt.tools": "tools",
    },
    install_requires=[
        "torch>=2.6",
        "triton>=3.0; platform_system == 'Linux'",
        "cuda-python>=12.6",
        "numpy",
        "rich>=13",
        "matplotlib>=3.7",
    ],
    # hf: transformers causal LMs on the runtime (cudagraph_rt.models.hf, --model hf:...).
    extras_require={"test": ["pytest>=7", "hypothesis>=6"], "hf": ["transformers>=5.17,<6"]},
    entry_points={"console_scripts": ["cgrt = cudagraph_rt.cli:main"]},
)
