"""flyspec inside other libraries' loops (the vLLM plugin is a package of its own: ``integrations/vllm/``).

- ``hf_generate.py``  transformers: ``model.generate(custom_generate=flyspec.custom_generate)``, ``from_transformers``
- ``lmeval.py``       lm-eval: the ``flyspec`` model (``python -m flyspec.integrations.lmeval``)
"""
