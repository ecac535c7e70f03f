"""The cost bench (bench/costs.py) end to end on a tiny shape on CPU: files, keys, and that the
oracle drafter gives the controlled acceptance it promises (no timing is asserted)."""
import json

from speculant.bench.costs import main


def test_costs_bench_tiny_shape(tmp_path):
    out = tmp_path / "costs"
    assert main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--target-shape", "tiny",
                 "--drafter-shape", "tiny", "--tokens", "12", "--out", str(out)]) == 0
    result = json.loads((out / "costs.json").read_text())
    row = result["shapes"][0]
    assert row["backend"] == "fast" and set(row["verify_ms_by_k"]) == {str(k) for k in range(1, 17)}
    assert row["floor_ms_per_token"] > 0 and result["copy_bandwidth_GBps"] > 0
    spec = result["speculative"]
    # α = 0.8 per token, γ = 5: τ = (1 - 0.8^6) / 0.2 = 3.69 in expectation; a broken oracle gives ~1
    assert spec["measured_tau"] > 2.0, spec
    assert (out / "costs.png").stat().st_size > 0
