"""Offline tools: GSM8K evaluation (:mod:`.eval_gsm8k`, :mod:`.gsm8k`), the soak run (:mod:`.soak`),
the tiny GPT-OSS makers (:mod:`.make_tiny_gpt_oss`: random weights; :mod:`.make_tiny_harmony_model`:
trained on CPU to answer in harmony form) and the persistent-checkpoint tool
(:mod:`.persistent_checkpoint`). The serving path never imports them."""
