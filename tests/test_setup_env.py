"""The environment's installer (scripts/setup_env.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.quick
def test_the_installer_hands_uv_the_sources_pip_is_configured_with(tmp_path):
    """uv does not read pip's configuration: setup_env.sh passes it every find-links, index, extra
    index and constraint of pip's config files and PIP_* variables, as uv's flags, so that uv
    resolves from what pip would (a local wheel of torch, a mirror, a machine's version caps)."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nfind-links = /wheels\nextra-index-url = file:///a/simple file:///b/simple\n"
                    "constraint = /caps.txt\n")
    script = "source <(sed -n '/^pip_sources()/,/^}/p' scripts/setup_env.sh); pip_sources"
    env = {**os.environ, "PIP_CONFIG_FILE": str(conf), "PIP_INDEX_URL": "https://mirror.example/simple",
           "venv": sys.prefix}
    out = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    flags = set(zip(lines[::2], lines[1::2]))
    assert {("--find-links", "/wheels"), ("--extra-index-url", "file:///a/simple"),
            ("--extra-index-url", "file:///b/simple"), ("--constraint", "/caps.txt"),
            ("--index-url", "https://mirror.example/simple")} <= flags, out
    assert all(flag.startswith("--") for flag in lines[::2]), out
