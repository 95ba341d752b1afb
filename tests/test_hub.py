"""A model named by its Hub id: `huggingface_hub`'s own client, pointed (HF_ENDPOINT) at a hub served
on this machine (tests/hub_server.py), downloads it once into the cache (HF_HOME) and gives its
snapshot; offline, the cache serves it; each bad id ends in one line naming the key, before Ray starts.
Each case runs in a process of its own: huggingface_hub reads its environment once, at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hub_server import TOKEN, Hub, serve

pytestmark = pytest.mark.quick

RESOLVE = """
import json, sys
from rlsys.config.loader import ConfigError
from rlsys.models import hub
try:
    print(json.dumps({"path": hub.resolve(sys.argv[1], "model.path")}))
except ConfigError as err:
    print(json.dumps({"error": str(err)}))
"""


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    hub = Hub()
    hub.add("test-org/tiny", tiny_model_dir)
    hub.add("test-org/gated", tiny_model_dir, gated=True)
    server, url = serve(hub)
    yield hub, url
    server.shutdown()


def user_env() -> dict:
    """This process's environment without its Hub settings (a run in this process set its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HF_")}


def resolve(name: str, hf_home, endpoint: str, **env: str) -> dict:
    environment = user_env()
    environment |= {"HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **env}
    result = subprocess.run([sys.executable, "-c", RESOLVE, name], capture_output=True, text=True, timeout=120,
                            env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_hub_id_is_downloaded_once_and_then_served_from_the_cache(served, tiny_model_dir, tmp_path):
    hub, url = served
    first = resolve("test-org/tiny", tmp_path, url)["path"]
    assert first.startswith(str(tmp_path)) and sorted(os.listdir(first)) == sorted(os.listdir(tiny_model_dir))
    for name in os.listdir(tiny_model_dir):
        assert open(os.path.join(first, name), "rb").read() == open(os.path.join(tiny_model_dir, name), "rb").read()
    sent = sum(count for (repo, _), count in hub.downloads.items() if repo == "test-org/tiny")
    assert sent == len(os.listdir(tiny_model_dir))
    sha = hub.repos["test-org/tiny"].sha
    assert resolve(f"test-org/tiny@{sha}", tmp_path, url)["path"] == first  # a revision: the same snapshot
    assert resolve("test-org/tiny", tmp_path, url, HF_HUB_OFFLINE="1")["path"] == first  # offline: the cache
    assert sum(count for (repo, _), count in hub.downloads.items() if repo == "test-org/tiny") == sent


def test_a_local_directory_is_never_taken_for_a_hub_id(tiny_model_dir, tmp_path, monkeypatch):
    from rlsys.models import hub

    monkeypatch.chdir(tmp_path)
    os.makedirs("org/model")
    assert hub.resolve("org/model", "model.path") == "org/model"
    assert hub.resolve(tiny_model_dir, "model.path") == tiny_model_dir


def test_each_bad_hub_id_is_one_line_naming_the_key(served, tmp_path):
    hub, url = served
    cases = {
        "test-org/missing": "model.path: test-org/missing: no such directory here, nor model at " + url,
        "test-org/tiny@v9": "model.path: test-org/tiny@v9: test-org/tiny has no revision 'v9'",
        "test-org/gated": "model.path: test-org/gated is gated: accept its terms on the Hub and set HF_TOKEN",
    }
    for name, expected in cases.items():
        assert resolve(name, tmp_path, url)["error"].startswith(expected), name
    assert "path" in resolve("test-org/gated", tmp_path, url, HF_TOKEN=TOKEN)  # with the token it comes
    assert resolve("test-org/tiny", tmp_path / "empty", url, HF_HUB_OFFLINE="1")["error"] == (
        f"model.path: test-org/tiny is not in the Hub cache ({tmp_path / 'empty' / 'hub'}) and HF_HUB_OFFLINE is set")
    assert resolve("test-org/tiny", tmp_path / "empty", "http://127.0.0.1:9")["error"].startswith(
        "model.path: test-org/tiny is not in the Hub cache")  # a hub that cannot be reached


def test_the_command_line_refuses_a_bad_hub_id_before_ray_starts(served, arith_files, tmp_path):
    _, url = served
    environment = {k: v for k, v in user_env().items() if k != "RAY_ADDRESS"}
    environment |= {"HF_HOME": str(tmp_path), "HF_ENDPOINT": url}
    result = subprocess.run([sys.executable, "-m", "rlsys.run", "sft", "--config", "examples/arith/sft.yaml",
                             "model.path=test-org/missing", f"output_dir={tmp_path / 'out'}",
                             f"data.train_files=[{arith_files['sft']}]"], capture_output=True, text=True,
                            timeout=120, env=environment)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"rlsys sft: error: model.path: test-org/missing: no such directory here, nor model at {url} (a private one "
        f"needs HF_TOKEN)"]
