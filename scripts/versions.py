"""Print the versions of the packages the project's tests touch, one `name==version` a line.

    python scripts/versions.py            # the venv's python: what this environment installed

Used by `make test-latest` and `make lock` (which versions a run tested) and by .ci/run.
"""
import importlib.metadata
import platform

# The distributions whose APIs the project calls (pyproject.toml's dependencies and test extras).
NAMES = ("torch", "triton", "numpy", "datasets", "torchdata", "tiktoken", "transformers", "tokenizers",
         "huggingface-hub", "safetensors", "kernels", "lm-eval", "scipy", "wandb", "tensorboard", "matplotlib",
         "pytest")


def versions() -> dict[str, str]:
    """{distribution: installed version or "not installed"} for NAMES, and the Python version."""
    found = {"python": platform.python_version()}
    for name in NAMES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


if __name__ == "__main__":
    for name, version in versions().items():
        print(f"{name}=={version}" if version != "not installed" else f"{name}: not installed")
