//! Text out of tokens as they come: what may be sent so far, holding back a piece that could
//! still become a stop string (or an incomplete character), and the text cut at a stop.

/// A completion's text as its tokens arrive.
#[derive(Debug, Default)]
pub struct TextOut {
    stop: Vec<String>,
    /// The text of every token so far.
    text: String,
    /// Bytes of `text` already sent.
    sent: usize,
}

impl TextOut {
    pub fn new(stop: Vec<String>) -> Self {
        TextOut {
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            ..TextOut::default()
        }
    }

    /// The whole text so far is `text` (the decoder's, of every token): returns what can be
    /// sent now, if anything, and whether a stop string was met (the text ends before it).
    pub fn update(&mut self, text: String) -> (Option<String>, bool) {
        self.text = text;
        if let Some(at) = self.stop_at() {
            self.text.truncate(at);
            return (self.take(at), true);
        }
        // An incomplete character decodes as U+FFFD: wait for the rest.
        let mut end = self.text.len();
        while self.text[..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        // A tail that could still grow into a stop string waits too.
        let held = self
            .stop
            .iter()
            .map(|s| longest_overlap(&self.text[..end], s))
            .max()
            .unwrap_or(0);
        (self.take(end - held), false)
    }

    /// What is left to send at the end. A character the last tokens left incomplete (the
    /// answer was cut by `max_tokens` inside it) decodes as U+FFFD: it is dropped, never sent.
    pub fn finish(&mut self) -> Option<String> {
        let mut end = self.stop_at().unwrap_or(self.text.len());
        while self.text[..end].ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        self.text.truncate(end.max(self.sent));
        self.take(end)
    }

    /// The whole text (cut at a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    fn stop_at(&self) -> Option<usize> {
        self.stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
    }

    fn take(&mut self, end: usize) -> Option<String> {
        let end = floor_char_boundary(&self.text, end);
        if end <= self.sent {
            return None;
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        Some(out)
    }
}

/// The largest `n` such that `text` ends with `stop`'s first `n` bytes (less than all of it).
fn longest_overlap(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_split_over_tokens_is_never_sent() {
        let mut out = TextOut::new(vec!["END".into()]);
        let mut sent = String::new();
        let mut stopped = false;
        let mut text = String::new();
        for piece in ["Hello", " wor", "ld E", "N", "D and more"] {
            text.push_str(piece);
            let (s, stop) = out.update(text.clone());
            sent.extend(s);
            if stop {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        sent.extend(out.finish());
        assert_eq!(sent, "Hello world ");
        assert_eq!(out.text(), "Hello world ");
    }

    #[test]
    fn an_answer_cut_inside_a_character_ends_before_it() {
        let mut out = TextOut::new(Vec::new());
        assert_eq!(out.update("ab\u{FFFD}".into()), (Some("ab".into()), false));
        assert_eq!(out.finish(), None);
        assert_eq!(out.text(), "ab");
        let mut whole = TextOut::new(Vec::new());
        assert_eq!(whole.update("x\u{FFFD}\u{FFFD}".into()).0, Some("x".into()));
        assert_eq!(whole.text(), "x\u{FFFD}\u{FFFD}");
        assert_eq!(whole.finish(), None);
        assert_eq!(whole.text(), "x");
    }

    #[test]
    fn held_back_text_goes_out_at_the_end_and_broken_characters_wait() {
        let mut out = TextOut::new(vec!["\n\n".into()]);
        assert_eq!(out.update("a\n".into()), (Some("a".into()), false));
        assert_eq!(
            out.update("a\nb\u{FFFD}".into()),
            (Some("\nb".into()), false)
        );
        assert_eq!(out.update("a\nbé".into()), (Some("é".into()), false));
        assert_eq!(out.update("a\nbé\n".into()), (None, false));
        assert_eq!(out.finish(), Some("\n".into()));
        assert_eq!(out.finish(), None);
    }
}
