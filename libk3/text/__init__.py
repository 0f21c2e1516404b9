"""Text and chat: the model's chat template (rendering), reply parsing, conversation
requests and the turns of a chat (formats/chat.md). Below the engine: nothing here runs
the model."""
