from setuptools import find_packages, setup

# The ranges this package works with, so that installing it where users train (SGLang's image,
# NGC containers, their own CUDA torch) leaves their torch alone. The exact versions the
# project is developed and tested with are in constraints.txt, which `make` installs with.
INSTALL_REQUIRES = [
    "torch>=2.13,<2.15",  # 2.13.0 (CPU) here; 2.14.1 in SGLang 0.5.23's image
    "megatron-core>=0.16.1,<0.17",
    "transformers>=5.19,<6",  # 5.19.0 is the release SGLang 0.5.23 is known to run with
    "safetensors>=0.6,<1",
    "pyyaml>=6.0",
    "sentencepiece>=0.2",
    "psutil>=5.9",  # dist_checkpointing needs it; megatron-core does not declare it
    "numpy>=1.26,<3",
    "aiohttp>=3.9,<4",  # the rollout client's event loop (SGLang depends on it too)
    "math-verify>=0.8,<0.10",  # the math answer reward
    "pyarrow>=15",  # Parquet prompt datasets
    "tensorboard>=2.15",  # metrics event files
    "matplotlib>=3.8",  # python -m gspo_mcore.run.plot
]

setup(
    name="gspo-mcore",
    version="0.1.0",
    description="Megatron-Core backend for GSPO reinforcement learning of Qwen3-MoE models",
    python_requires=">=3.11",
    packages=find_packages(include=["gspo_mcore", "gspo_mcore.*", "checkpoint_convert", "checkpoint_convert.*"]),
    entry_points={"console_scripts": ["gspo-train = gspo_mcore.run.cli:train_cli", "gspo-eval = gspo_mcore.evaluation.cli:cli",
                                        "gspo-rehearse = gspo_mcore.rehearsal.cli:cli"]},
    package_data={"gspo_mcore": ["data/samples/*.jsonl", "rehearsal/fake_cuda.cpp"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "gpu": ["transformer-engine[core_cu13,pytorch]>=2.9,<2.12", "sglang>=0.5.23,<0.6"],
        "wandb": ["wandb>=0.19,<1"],  # train.wandb_project
        "test": ["pytest>=8,<9", "pytest-xdist>=3.5", "wandb>=0.19,<1"],  # xdist groups need pytest 8
    },
)
