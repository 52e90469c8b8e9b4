"""LoRA adapters as requests name them (``request.py``) and PEFT saves them (``adapter.py``);
``layers/lora.py`` adds their products to the decoder's linear layers, ``worker/lora_manager.py``
keeps them in slots."""
