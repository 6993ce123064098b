"""``python -m decoder`` (inside ``examples/``): serve the chat workload on kvref and kvfast,
compare with ONNX Runtime."""

import kvfast
import kvref

from . import Decoder, DecoderConfig, ManagerServer, OrtDecoder, SlotCacheServer, chat_workload, compare, reference_run

cfg = DecoderConfig(windows=(None, 6, None))
model = Decoder(cfg)
requests = chat_workload(cfg.vocab_size)
reference = reference_run(OrtDecoder(cfg, model.weights), requests)
for pkg in (kvref, kvfast):
    for name, server in (("slot cache, paged", SlotCacheServer(pkg, model, num_blocks=20)),
                         ("manager", ManagerServer(pkg, model, num_blocks=16, max_seq_len=40))):
        result = server.serve(requests)
        worst = compare(result, reference, atol=1e-4)
        print(f"{pkg.__name__:6} {name:18} tokens equal, max |logit diff| {worst:.2e}, {result.stats}")
