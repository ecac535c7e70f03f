"""Chain τ of two EAGLE heads on the target's greedy answers (float32, <= 128 tokens) to 24 random
ShareGPT first turns (group A of `gpu_eagle.py prompts --skip 7168`): general chat, not tasks."""
import json, random, sys
import torch
from safetensors.torch import load_file
from speculant.models.loading import load_model
from speculant.tools import texts
from speculant.tools.train_batched import tapped_features
from speculant.trained.eagle import EagleNet, EagleTrainer
torch.set_grad_enabled(False)
target = load_model("default", device="cpu", dtype="float32")
model, tok = target.model, target.tokenizer
A = texts.sharegpt_prompts(tok, 7168)["A"]
prompts = random.Random(5).sample([p for p in A if len(p) <= 256], 24)
seqs = []
for p in prompts:
    x = p.long()[None]
    g = model.generate(x, max_new_tokens=128, do_sample=False, eos_token_id=sorted(target.eos_token_ids))[0, x.shape[1]:]
    ends = [j for j, t in enumerate(g.tolist()) if t in target.eos_token_ids]
    seqs.append((torch.cat([x[0], g[: ends[0] + 1] if ends else g]), x.shape[1]))
out = {}
for name, d in [("shipped", sys.argv[1]), ("new", sys.argv[2])]:
    cfg = json.loads(open(f"{d}/config.json").read())
    net = EagleNet(cfg)
    net.load_state_dict({k: v.float() for k, v in load_file(f"{d}/model.safetensors").items()}, strict=False)
    net.eval()
    trainer = EagleTrainer(net, model.get_input_embeddings(), model.get_output_embeddings(), 3)
    feats = tapped_features(model, cfg["eagle_aux_hidden_state_layer_ids"], seqs, 4096, "cpu")
    m = trainer.evaluate(feats, random.Random(1))
    out[name] = dict(chain_tau=round(m["tau"], 3), alpha=m["alpha_by_slot"])
    print(name, out[name], flush=True)
json.dump({"what": __doc__, "by_head": out}, open(sys.argv[3], "w"), indent=1)
