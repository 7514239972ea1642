# ftcore on NVIDIA's PyTorch image: the image's torch, Transformer Engine, NCCL and CUDA stay as
# they are; pip adds megatron-core, transformers, peft, hydra, ... and ftcore around them.
#   docker build -t ftcore .            (or: enroot import dockerd://ftcore / apptainer build)
# The base must hold a Transformer Engine that runs every recipe of conf/precision/ (NVFP4 needs
# TE >= 2.7; 25.06 shipped an older one). 25.11 ships TE 2.9, CUDA 13.0, torch 2.10, Python 3.12:
# NGC PyTorch release notes, docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-25-11.html
# (Megatron-Bridge's CI image moved to 25.11 too). Pin and TE are checked by tests/unit/precision/test_ngc.py
# against ftcore/precision/ngc.py's table, and by `python -m ftcore.precision.ngc` below against the TE really installed.
# Another base: add its row to ftcore/precision/ngc.py, then `docker build --build-arg BASE_IMAGE=...`.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

# FTCORE_GPU_REQUIRE_TE=1 -> gpu.require_te=true: inside this image a missing or broken Transformer
# Engine fails the run and the GPU tests instead of silently using megatron's local layers.
# No GPU variable ftcore chooses per config (CUDA_DEVICE_MAX_CONNECTIONS, NCCL_*, NVTE_*: see
# ftcore/runtime/gpu_env.py) is set here: a value already in the environment wins over ftcore's.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FTCORE_GPU_REQUIRE_TE=1

WORKDIR /opt/ftcore
COPY pyproject.toml README.md ./
COPY ftcore ./ftcore
COPY conf ./conf
COPY launch ./launch
COPY slurm ./slurm

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# 1. Pin what the image built together (torch, triton, Transformer Engine, flash-attn, apex, numpy,
#    the CUDA wheels) to the installed versions: no dependency can pull a replacement from PyPI,
#    pip fails loudly instead.
# 2. Install ftcore without dependencies, then its dependencies minus torch and Transformer Engine
#    (the image's builds are the `gpu` extra here; TE from PyPI would be a second, mismatched copy).
# 3. Check that torch and Transformer Engine are the very same versions afterwards, and that this
#    Transformer Engine runs every precision recipe ftcore ships (ftcore.precision.ngc).
RUN pip list --format=freeze \
      | grep -i -E '^(torch[a-z]*|triton|transformer[-_]engine[-_a-z]*|flash[-_]attn[a-z0-9_-]*|apex|numpy|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==' \
      > /tmp/image-constraints.txt \
 && grep -i -E '^(torch|transformer[-_]engine[-_a-z]*)==' /tmp/image-constraints.txt > /tmp/kept.txt \
 && pip install --no-cache-dir --no-deps . \
 && python -c "import importlib.metadata as m, re; print('\n'.join(r.split(';')[0] for r in m.requires('ftcore') if 'extra ==' not in r and not re.match(r'(torch|transformer.engine)\b', r, re.I)))" \
      > /tmp/ftcore-deps.txt \
 && pip install --no-cache-dir -c /tmp/image-constraints.txt -r /tmp/ftcore-deps.txt \
 && pip list --format=freeze | grep -i -E '^(torch|transformer[-_]engine[-_a-z]*)==' | diff /tmp/kept.txt - \
 && python -c "import ftcore.launch.node, ftcore.config.schema, megatron.core; print('ftcore ready')" \
 && python -m ftcore.precision.ngc

WORKDIR /workspace
CMD ["python", "-m", "ftcore.train", "--help"]
