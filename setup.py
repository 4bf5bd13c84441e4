"""flashqla: fused TileLang GDN kernels for Hopper, exact context parallelism, framework adapters.

`kernels/` is shipped as the subpackage `flashqla.kernels` (a top-level `kernels` module would clash
with an unrelated PyPI project).
"""
from setuptools import find_packages, setup

packages = find_packages(include=["flashqla", "flashqla.*"])
kernel_packages = ["flashqla.kernels" + p[len("kernels"):] for p in find_packages(include=["kernels", "kernels.*"])]

setup(
    name="flashqla",
    version="0.1.0",
    description="Gated DeltaNet chunked prefill: TileLang SM90 kernels, reference backend, context parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages + kernel_packages,
    package_dir={"flashqla.kernels": "kernels"},
    install_requires=["torch>=2.4"],
    # kernels compiled for sm_90a by `flashqla precompile --cache-dir kernels/prebuilt` before building
    # the wheel (docs/prebuilt_kernels.md); copied into TileLang's cache on first use
    package_data={"flashqla.kernels": ["prebuilt/*/*/kernels/*/*", "prebuilt/*/*/flashqla-index/*.json.gz"]},
    entry_points={"console_scripts": ["flashqla = flashqla.cli:main"]},
    extras_require={
        # the tests compile every kernel configuration for sm_90a (nvcc only, no GPU needed)
        "test": ["pytest>=7", "numpy", "transformers==5.23.0", "deepspeed==0.19.8", "matplotlib", "tqdm",
                 "tilelang==0.1.15", "apache-tvm-ffi>=0.1.11,<0.1.13"],
        "tilelang": ["tilelang==0.1.15", "apache-tvm-ffi>=0.1.11,<0.1.13"],
        "megatron": ["megatron-core>=0.19,<0.20"],
        "deepspeed": ["deepspeed>=0.19,<0.20", "transformers>=4.57"],
        "examples": ["transformers==5.23.0", "deepspeed==0.19.8", "matplotlib", "tqdm"],
        "hf": ["transformers>=4.57"],
    },
)
