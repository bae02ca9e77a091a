//! The GPT-2 style byte-level BPE a llama GGUF carries, built with the `tokenizers` crate from
//! the vocabulary and merges in its metadata.

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::gguf::TokenizerData;
use crate::ModelError;

/// Why the tokenizer could not be built, or could not take a text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A merge in the GGUF is not two tokens separated by a space.
    #[error("merge {0:?} is not two tokens")]
    Merge(String),
    /// The vocabulary and merges do not make a BPE.
    #[error("BPE: {0}")]
    Build(#[source] tokenizers::Error),
    /// A text could not be encoded.
    #[error("encode: {0}")]
    Encode(#[source] tokenizers::Error),
    /// Token ids could not be decoded.
    #[error("decode: {0}")]
    Decode(#[source] tokenizers::Error),
    /// A chat message of a role the template does not know.
    #[error("a message of role {0:?}")]
    Role(String),
}

/// Text in, token ids out, and back.
pub struct TextCodec {
    tokenizer: Tokenizer,
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
        Ok(TextCodec {
            tokenizer,
            eos: data.eos,
        })
    }

    /// Tokens the vocabulary has (special ones included): ids run below it.
    pub fn vocab(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids of `text` (special tokens written out are recognised).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode(e).into())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| TokenizerError::Decode(e).into())
    }

    /// A chat prompt in the model's template (ChatML): an optional system message, the user's.
    pub fn chat(&self, system: Option<&str>, user: &str) -> Result<Vec<u32>, ModelError> {
        let mut text = String::new();
        if let Some(s) = system {
            text.push_str(&format!("<|im_start|>system\n{s}<|im_end|>\n"));
        }
        text.push_str(&format!(
            "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        ));
        self.encode(&text)
    }

    /// A conversation in the model's template (ChatML), ending where the assistant's next
    /// message starts: `(role, content)` pairs, roles `system`, `user` or `assistant`.
    pub fn chat_messages(&self, messages: &[(&str, &str)]) -> Result<Vec<u32>, ModelError> {
        let mut text = String::new();
        for (role, content) in messages {
            if !matches!(*role, "system" | "user" | "assistant") {
                return Err(TokenizerError::Role(role.to_string()).into());
            }
            text.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        text.push_str("<|im_start|>assistant\n");
        self.encode(&text)
    }
}
