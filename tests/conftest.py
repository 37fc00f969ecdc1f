import os
import tempfile

import pytest

# Load-time measurements (kernels/autotune.py) are kept per test session, not in the
# user's cache folder.
os.environ.setdefault("MACINFER_CACHE_DIR", tempfile.mkdtemp(prefix="macinfer-test-cache-"))
# The prompt-attention op forms fixed to the CPU's default, so numerics (and the sampled
# text of long agent runs) do not depend on a timing taken while other tests load the
# machine; tests/test_autotune.py measures with this lifted.
os.environ.setdefault("MACINFER_FORCE_ATTENTION_OPS", "explicit")

from tests.helpers import tiny_model_dir


def _patient_httpx(seconds: float = 300.0) -> None:
    """No client timeout shorter than the work it waits for: httpx's default is 5 s, and on
    two busy cores a 900-token prompt alone takes ~10 s (#40). Every httpx call and client
    the tests make without a timeout of their own waits up to `seconds`."""
    import httpx

    patient = httpx.Timeout(seconds)
    for fn in (httpx.request, httpx.stream, httpx.get, httpx.post, httpx.put, httpx.patch, httpx.delete,
               httpx.head, httpx.options, httpx.Client.__init__, httpx.AsyncClient.__init__):
        if fn.__kwdefaults__ and "timeout" in fn.__kwdefaults__:
            fn.__kwdefaults__["timeout"] = patient


_patient_httpx()


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from macinfer.loading.loader import bundled_test_model

    return bundled_test_model()


@pytest.fixture(scope="session")
def smollm2_mlx_dir(smollm2_gguf, tmp_path_factory) -> str:
    """The bundled GGUF converted to an MLX directory mlx-lm can load."""
    from macinfer.loading.convert import convert_gguf

    return convert_gguf(smollm2_gguf, str(tmp_path_factory.mktemp("smollm2-mlx")))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf):
    from macinfer.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(smollm2_gguf, EngineConfig(kv_cache_gb=0.25, max_model_len=2048, max_num_seqs=16))


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf):
    """One `macinfer serve` of the bundled model for the modules that only send it requests
    (tests/test_server.py, test_tools_api.py, test_api_edges.py): started once a session.
    Speculation on: solo requests draft, 16 or 32 concurrent ones do not, and every test comparing
    them (or streams with non-streamed answers) checks they agree."""
    from tests.server_process import ServerProcess

    s = ServerProcess(smollm2_gguf, "--served-model-name", "smollm2", "--kv-cache-gb", "0.2",
                      "--max-model-len", "1024", "--max-num-seqs", "32", "--max-queue", "256",
                      "--num-speculative-tokens", "4")
    yield s
    out = s.stop()
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    path, _ = tiny_model_dir(tmp_path_factory.mktemp("tiny"), "llama")
    return path


def pytest_report_header(config):
    return f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}"


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory) -> dict[str, str]:
    """Every vision family's tiny checkpoint (`tests/vision_families/`), built once."""
    from tests.vision_models import BUILDERS, tiny_vlm_dir

    base = tmp_path_factory.mktemp("vlm")
    return {family: tiny_vlm_dir(base, family) for family in BUILDERS}
