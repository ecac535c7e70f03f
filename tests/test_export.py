"""speculant export --format vllm: the written config only uses vLLM's SpeculativeConfig fields."""
import json

import pytest

from speculant.cli import main
from speculant.export import vllm_config

# vLLM's SpeculativeConfig (vllm/config/speculative.py): the keys a user passes and the methods
VLLM_FIELDS = {"enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size",
               "quantization", "max_model_len", "revision", "code_revision", "disable_padded_drafter_batch",
               "prompt_lookup_max", "prompt_lookup_min", "parallel_drafting", "suffix_decoding_max_tree_depth",
               "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob", "rejection_sample_method", "draft_sample_method"}
VLLM_METHODS = {"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "eagle", "eagle3", "dflash", "mtp"}


@pytest.mark.parametrize("drafter", ["ngram", "ngram:tree", "suffix"])
def test_model_free_drafters_map_to_vllm_methods(drafter):
    cfg = vllm_config(drafter)
    assert set(cfg) <= VLLM_FIELDS and cfg["method"] in VLLM_METHODS and cfg["num_speculative_tokens"] > 0


def test_a_dflash_folder_exports_its_path_and_block(tmp_path, capsys):
    from helpers import tiny_llama
    from speculant.trained.dflash import DFlashNet
    from speculant.trained.dflash import dflash_config
    from speculant.trained.format import save_folder

    cfg = dflash_config(tiny_llama(0), "tiny", layers=1, taps=[0, 1], block_size=6, mask_token_id=95)
    save_folder(tmp_path / "d", cfg, dict(DFlashNet(cfg).state_dict()))
    out = tmp_path / "spec.json"
    assert main(["export", "--drafter", f"dflash:{tmp_path / 'd'}", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written == {"method": "dflash", "model": str((tmp_path / "d").resolve()), "num_speculative_tokens": 5}
    assert set(written) <= VLLM_FIELDS
    assert "vllm serve" in capsys.readouterr().out


@pytest.mark.parametrize("drafter,message", [("none", "speculates nothing"), ("layerskip", "no vLLM counterpart"),
                                             ("model:default", "Hugging Face folders")])
def test_drafters_without_a_vllm_counterpart_are_one_line(drafter, message, capsys):
    assert main(["export", "--drafter", drafter, "--out", "/dev/null"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("args,message", [(["--gamma=-1"], "gamma"), (["--gamma", "0"], "gamma"),
                                          (["--out", "/proc/no/such.json"], "cannot write")])
def test_a_bad_gamma_or_output_path_is_one_line(args, message, capsys):
    assert main(["export", "--drafter", "ngram", *(["--out", "/dev/null"] if "--out" not in args else []), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
