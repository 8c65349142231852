"""Distribution ``mpidp``: MPI-based differentially private training.

The four packages sit at the top level of the repository, as the project's
layout asks (see README, "Layout"); ``mpidp`` is the console script.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="mpidp",
    version="0.1.0",  # the one place; engine.__version__ reads it from the metadata
    description="MPI-based engine for differentially private training (DP-SGD) "
    "on census microdata",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # Every sub-package of the four top-level packages (a new sub-package
    # needs no edit here).
    packages=find_packages(include=["engine", "engine.*", "kernels", "kernels.*",
                                    "collectives", "collectives.*", "preprocessing",
                                    "preprocessing.*"]),
    # The CuPy kernels compile their CUDA C (kernels/cupy/*.cu) at run time.
    package_data={"kernels.cupy": ["*.cu"], "preprocessing": ["*.json"]},
    install_requires=[
        "mpi4py>=4.0",
        # An MPI that installs with pip, for machines without a system MPI.
        # On clusters, build mpi4py against the site MPI instead (docs/clusters.md).
        "mpich>=4.2; platform_system == 'Linux'",
        "numpy>=1.26",
        "torch>=2.2",
        "numba>=0.60",
        "h5py>=3.10",
        "polars>=2.0",  # CSV parsing in mpidp prep / synth
        "cryptography>=41",  # AES for prep's keyed household keys (one call per split)
        "dp-accounting>=0.4.4",
        "tqdm>=4.66",
        "matplotlib>=3.7",  # PNG plots of the benchmarks
        "scipy>=1.11",  # exact binomial intervals in mpidp audit
        "tomli>=2.0; python_version < '3.11'",  # mpidp prep --task-file (tomllib from 3.11)
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-mpi>=0.6",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # tests/run_suite.py spreads the serial stage over the cores
            "hypothesis>=6.100",
            # The independent accountant the PLD is checked against (its PRV);
            # needs torch, which the Makefile pins to the CPU wheel.
            "opacus>=1.5",
            # The reference the built-in tasks are checked against
            # (tests/test_prep_tasks.py: the same rows and labels on real files);
            # the test reads the Census zips with pandas, folktables' dependency.
            "folktables>=0.0.12",
            "pandas>=2.0",
            # The independent reference of the per-group figures of mpidp eval --by
            # (tests/test_engine_groups.py: confusion matrices per group).
            "scikit-learn>=1.3",
            # Numba's CUDA target as the GPU extras install it (without its NVRTC
            # wheels): the suite imports and simulates it, so a release that
            # cannot load under the installed numpy fails here, not on a GPU node.
            "numba-cuda>=0.20",
        ],
        # Reference implementation compared in `mpidp bench dpsgd` (optional).
        "opacus": ["opacus>=1.5"],
        # GPUs (--device cuda): pick the extra matching torch.version.cuda, and
        # never install both (a CUDA 12 CuPy silently loads a CUDA 13 NVRTC).
        "cuda12": [
            "cupy-cuda12x>=13.0",
            "numba-cuda[cu12]>=0.20",
        ],
        "cuda13": [
            "cupy-cuda13x>=14.0",
            "numba-cuda[cu13]>=0.20",
        ],
    },
    entry_points={"console_scripts": ["mpidp = engine.cli:console"]},
)
