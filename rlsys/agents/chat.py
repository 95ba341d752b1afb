"""The chat template's tokens between sampled turns, rendered once and never around sampled tokens.

A multi-turn trajectory is the prompt's tokens, then each sampled turn as the engine sampled
it, then the template's tokens for what comes between: the end of the assistant turn that
the engine did not sample (Qwen's newline after `<|im_end|>`), the tool messages, and the
next assistant turn's generation prompt. Those are the template's rendering of a fixed
conversation with the tool messages appended, minus its rendering without them, so the
model's own tokens are never re-tokenized: nothing drifts between what was sampled and
what is trained on.

That difference is exact for templates that render a conversation's prefix as a prefix of
the whole (append-only). Templates that rewrite earlier turns (Qwen3 and DeepSeek-R1 drop
the reasoning of earlier assistant turns; gpt-oss drops the analysis channel) would render
a later turn's context differently from the tokens the trajectory holds: the trajectory
keeps what was sampled, as the engine saw it. A template whose tool turn does not extend the
fixed conversation is refused when the loop starts.
"""

from __future__ import annotations

from rlsys.data.examples import PROBE_CONVERSATION, chat_ids, turn_end_ids


class TemplateError(ValueError):
    pass


class ChatTurns:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.conversation_ids = chat_ids(PROBE_CONVERSATION, tokenizer, add_generation_prompt=False)
        turn_end = turn_end_ids(tokenizer)
        if turn_end is None:
            raise TemplateError("the chat template does not render an assistant turn after its generation prompt")
        self.turn_end = turn_end
        """The template's tokens after an assistant turn's content (`<|im_end|>`, a newline)."""

    def after_turn(self, sampled_ids: list[int]) -> list[int]:
        """The end of an assistant turn that the engine did not sample: the template's turn end past
        the end-of-turn token the engine stopped at (all of it if it stopped elsewhere)."""
        end = self.turn_end
        return end[1:] if end and sampled_ids and sampled_ids[-1] == end[0] else list(end)

    def next_turn(self, messages: list[dict]) -> list[int]:
        """Tokens of `messages` (tool or user turns) and the next assistant generation prompt."""
        ids = chat_ids(PROBE_CONVERSATION + messages, self.tokenizer, add_generation_prompt=True)
        if ids[:len(self.conversation_ids)] != self.conversation_ids:
            raise TemplateError("the chat template renders a conversation with a tool turn appended differently "
                                "from the conversation before it (not append-only)")
        return ids[len(self.conversation_ids):]
