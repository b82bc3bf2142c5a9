"""The model layer: HF configs and meta-device models, layout-independent weights, adapters, loss.

- facts.py: model sizes from a snapshot of the HF config classes (no torch import; for dry runs).
- adapters.py: where embeddings, layers, norm, head, rotary and experts live in each family.
- build.py: `hf_config`, `build_meta_model`.
- init.py: `materialize` (random init or pretrained safetensors, any sharding).
- random_init.py, pretrained.py, shards.py: its parts (init oracle, checkpoint reader, local shards).
- loss.py: `forward_loss`, `token_loss`.

Nothing is imported here, so `import partrain.blueprint.model_facts` stays free of torch.
"""
