"""CPU import shims (sgl_kernel, torchvision); see README.md. Calling a shimmed name raises ShimCalledError."""

from sgl_kvq.cpu_shims._placeholder import ShimCalledError

__all__ = ["ShimCalledError"]
