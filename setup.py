"""hybridsync: per-variable gradient synchronization for Horovod data-parallel training."""
from setuptools import find_packages, setup

setup(
    name="hybridsync",
    version="0.1.0",
    description="Learns, per variable, how to synchronize gradients: ring or hierarchical "
    "all-reduce or a parameter server, with partitioning and merging.",
    python_requires=">=3.11",
    packages=find_packages(include=["hybridsync", "hybridsync.*"]),
    package_data={"hybridsync.model": ["simulator.json"]},
    install_requires=["numpy", "PyYAML"],
    extras_require={"horovod": ["horovod==0.28.1", "torch==2.13.0"], "search": ["xgboost", "scipy"]},
    entry_points={
        "console_scripts": [
            "hybridsync = hybridsync.cli:main",
            "hybridsync-run = hybridsync.cli:run_main",
            "hybridsync-server = hybridsync.backends.ps.server:main",
        ]
    },
)
