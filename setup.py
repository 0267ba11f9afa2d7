"""The one C extension, kvheat.tiers._copyhash: a host-tier copy and its xxh3 checksum in one
pass (kvheat/tiers/_csrc). Optional: where it cannot be built (no C compiler, no Python
headers) the package installs without it and the host tier copies with torch and hashes with
the xxhash package (slower: docs/tiers.md, Bandwidth). Everything else is in pyproject.toml."""

import platform

from setuptools import Extension, setup

CSRC = "kvheat/tiers/_csrc"
sources = [f"{CSRC}/copyhash.c", f"{CSRC}/copyhash_kernels.c", f"{CSRC}/xxhash.c"]
macros: list[tuple[str, str | None]] = [("XXH_NAMESPACE", "kvheat_")]
if platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}:
    # xxhash's own run-time dispatch (SSE2 / AVX2 / AVX-512) for the portable kernel.
    sources.append(f"{CSRC}/xxh_x86dispatch.c")
    macros.append(("KVHEAT_X86_DISPATCH", "1"))

setup(ext_modules=[Extension(
    "kvheat.tiers._copyhash", sources, include_dirs=[CSRC], define_macros=macros,
    extra_compile_args=[] if platform.system() == "Windows" else ["-O3"], optional=True,
)])
