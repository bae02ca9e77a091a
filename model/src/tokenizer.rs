//! The GPT-2 style byte-level BPE a llama GGUF carries, built with the `tokenizers` crate from
//! the vocabulary and merges in its metadata.

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::ModelError;
pub use crate::error::TokenizerError;
use crate::gguf::TokenizerData;

/// Text in, token ids out, and back.
///
/// Text that comes from a user is encoded as text ([`TextCodec::encode_text`]): a control
/// token's name written in it (`<|im_end|>`) becomes the ordinary tokens of those characters,
/// so a control token comes only from the template ([`TextCodec::chat_messages`]).
pub struct TextCodec {
    tokenizer: Tokenizer,
    /// The same vocabulary with every special token's text taken as plain text.
    plain: Tokenizer,
    /// `<|im_start|>` and `<|im_end|>`, where the vocabulary has them.
    im_start: Option<u32>,
    im_end: Option<u32>,
    /// End of sequence (generation stops there).
    pub eos: Option<u32>,
}

impl TextCodec {
    /// Builds the BPE from the GGUF's vocabulary and merges; tokens written `<|...|>` are
    /// special (never split, skipped when decoding completions).
    pub fn new(data: &TokenizerData) -> Result<Self, ModelError> {
        let vocab: Vocab = data
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = data
            .merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| TokenizerError::Merge(m.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(TokenizerError::Build)?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        let special: Vec<AddedToken> = data
            .tokens
            .iter()
            .filter(|t| t.starts_with("<|") && t.ends_with("|>"))
            .map(|t| AddedToken::from(t.clone(), true))
            .collect();
        tokenizer.add_special_tokens(&special);
        let mut plain = tokenizer.clone();
        plain.set_encode_special_tokens(true);
        Ok(TextCodec {
            im_start: tokenizer.token_to_id("<|im_start|>"),
            im_end: tokenizer.token_to_id("<|im_end|>"),
            tokenizer,
            plain,
            eos: data.eos,
        })
    }

    /// Tokens the vocabulary has (special ones included): ids run below it.
    pub fn vocab(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids of `text`, special tokens written out recognised as control tokens: for
    /// text the program writes, never for a user's (see [`TextCodec::encode_text`]).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e).into())
    }

    /// Token ids of `text` as text: a special token's name in it is encoded as its
    /// characters, never as the control token.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.plain
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e).into())
    }

    /// The bytes one token stands for: a special token's text, or the bytes the byte-level
    /// vocabulary's characters map back to (part of a character, maybe). Empty for an id
    /// past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(text) = self.tokenizer.id_to_token(id) else {
            return Vec::new();
        };
        if self
            .tokenizer
            .get_added_vocabulary()
            .is_special_token(&text)
        {
            return text.into_bytes();
        }
        text.chars().map(|c| byte_of(c).unwrap_or(b'?')).collect()
    }

    /// The ids of the vocabulary's special tokens (those written `<|...|>`), with their text.
    pub fn special_tokens(&self) -> Vec<(u32, String)> {
        let mut out: Vec<(u32, String)> = self
            .tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        out.sort();
        out
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizerError::Decode(e).into())
    }

    /// A chat prompt in the model's template (ChatML): an optional system message, the user's.
    pub fn chat(&self, system: Option<&str>, user: &str) -> Result<Vec<u32>, ModelError> {
        let mut messages = Vec::with_capacity(2);
        if let Some(s) = system {
            messages.push(("system", s));
        }
        messages.push(("user", user));
        self.chat_messages(&messages)
    }

    /// A conversation in the model's template (ChatML), ending where the assistant's next
    /// message starts: `(role, content)` pairs, roles `system`, `user` or `assistant`. The
    /// control tokens are the template's alone: each message's text is encoded as text
    /// ([`TextCodec::encode_text`]), between the same pieces a whole ChatML text would be
    /// split into, so an ordinary conversation gets the same ids either way.
    pub fn chat_messages(&self, messages: &[(&str, &str)]) -> Result<Vec<u32>, ModelError> {
        let start = self
            .im_start
            .ok_or(TokenizerError::NoTemplate("<|im_start|>"))?;
        let end = self
            .im_end
            .ok_or(TokenizerError::NoTemplate("<|im_end|>"))?;
        let newline = self.encode_text("\n")?;
        let mut ids = Vec::new();
        for (role, content) in messages {
            if !matches!(*role, "system" | "user" | "assistant") {
                return Err(TokenizerError::Role(role.to_string()).into());
            }
            ids.push(start);
            ids.extend(self.encode_text(&format!("{role}\n{content}"))?);
            ids.push(end);
            ids.extend_from_slice(&newline);
        }
        ids.push(start);
        ids.extend(self.encode_text("assistant\n")?);
        Ok(ids)
    }
}

/// The byte a byte-level BPE character stands for (GPT-2's table: printable Latin-1 bytes
/// are themselves, the other 68 bytes are U+0100 onwards, in order).
fn byte_of(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let c = c as u32;
    if c < 0x100 {
        return printable(c).then_some(c as u8);
    }
    let n = c - 0x100;
    (0u32..0x100)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::byte_of;

    #[test]
    fn the_byte_level_table_maps_back_every_byte_once() {
        let mut seen = [false; 256];
        for c in (0x21u32..0x17f).filter_map(char::from_u32) {
            if let Some(b) = byte_of(c) {
                assert!(!seen[b as usize], "{c:?}");
                seen[b as usize] = true;
            }
        }
        assert!(seen.iter().all(|s| *s));
        assert_eq!(byte_of('\u{120}'), Some(b' '));
        assert_eq!(byte_of('\u{10a}'), Some(b'\n'));
        assert_eq!(byte_of('a'), Some(b'a'));
    }
}
