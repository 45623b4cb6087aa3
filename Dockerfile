# The image of a GKE workload (docs/pods.md#on-gke-with-xpk): PyTorch/XLA 2.9's TPU image
# (Python 3.10 with torch, torch_xla and libtpu), this repo's files in /refs, and the rest
# of the TPU VM's install line (versions for Python 3.10 from constraints.txt).
FROM us-central1-docker.pkg.dev/tpu-pytorch-releases/docker/xla:r2.9.0_3.10_tpuvm
WORKDIR /refs
COPY requirements.txt requirements-tpu.txt constraints.txt ./
RUN pip install --no-cache-dir -r requirements-tpu.txt -c constraints.txt
COPY . .
