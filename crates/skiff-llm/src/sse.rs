//! Incremental parser for `text/event-stream` framing (the WHATWG server-sent events format):
//! bytes in, events out, whatever the chunking.
//!
//! It owns line splitting and field handling only; what an event's data means belongs to the
//! adapters. `id` and `retry` fields are ignored because the adapters never reconnect.

/// One dispatched event: its `event:` field, if any, and its `data:` lines joined by `\n`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the current line. Kept as bytes until the line ends so that a UTF-8 character
    /// split across network chunks is decoded whole.
    line: Vec<u8>,
    /// The last byte seen was `\r`, so a `\n` right after it completes the same line break.
    after_cr: bool,
    event: Option<String>,
    /// Every `data:` line so far, each followed by `\n` (the spec's data buffer).
    data: String,
}

impl SseParser {
    /// Feeds the next chunk of the body and returns the events it completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        for &byte in bytes {
            let after_cr = std::mem::replace(&mut self.after_cr, byte == b'\r');
            match byte {
                b'\n' if after_cr => {}
                b'\r' | b'\n' => self.end_line(&mut events),
                _ => self.line.push(byte),
            }
        }
        events
    }

    /// Ends the body. The spec drops an event that no blank line terminated; this dispatches it,
    /// because some OpenAI-compatible servers close the connection right after `data: [DONE]`
    /// and treating that as a truncated response would fail a complete answer.
    pub fn finish(mut self) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if !self.line.is_empty() {
            self.end_line(&mut events);
        }
        self.dispatch(&mut events);
        events
    }

    fn end_line(&mut self, events: &mut Vec<SseEvent>) {
        let bytes = std::mem::take(&mut self.line);
        let line = String::from_utf8_lossy(&bytes);
        if line.is_empty() {
            return self.dispatch(events);
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (&*line, ""),
        };
        match field {
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
            }
            "event" => self.event = (!value.is_empty()).then(|| value.to_owned()),
            _ => {}
        }
    }

    fn dispatch(&mut self, events: &mut Vec<SseEvent>) {
        let event = self.event.take();
        let mut data = std::mem::take(&mut self.data);
        // An event without data lines is not dispatched (per spec), only reset.
        if data.pop().is_some() {
            events.push(SseEvent { event, data });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    fn parse_chunks(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut parser = SseParser::default();
        let mut events: Vec<SseEvent> = chunks.iter().flat_map(|c| parser.push(c)).collect();
        events.extend(parser.finish());
        events
    }

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
        }
    }

    #[test]
    fn handles_every_line_ending_fields_and_comments() {
        let body = b": keep-alive\r\nevent: ping\r\ndata: {}\r\n\r\ndata: a\rdata:b\r\rdata\n\nid: 7\nretry: 10\n\n";
        assert_eq!(
            parse_chunks(&[body]),
            vec![ev(Some("ping"), "{}"), ev(None, "a\nb"), ev(None, "")]
        );
    }

    #[test]
    fn event_type_does_not_leak_into_the_next_event() {
        let body = b"event: a\ndata: 1\n\ndata: 2\n\nevent: lonely\n\ndata: 3\n\n";
        assert_eq!(
            parse_chunks(&[body]),
            vec![ev(Some("a"), "1"), ev(None, "2"), ev(None, "3")]
        );
    }

    #[test]
    fn crlf_and_utf8_split_across_chunks() {
        let body = "data: héllo\r\n\r\n".as_bytes();
        // Split inside `é` and between `\r` and `\n`.
        let (a, rest) = body.split_at(8);
        let (b, c) = rest.split_at(rest.len() - 3);
        assert_eq!(parse_chunks(&[a, b, c]), vec![ev(None, "héllo")]);
    }

    #[test]
    fn finish_dispatches_an_unterminated_event() {
        assert_eq!(parse_chunks(&[b"data: [DONE]"]), vec![ev(None, "[DONE]")]);
        assert_eq!(parse_chunks(&[b"data: x\n"]), vec![ev(None, "x")]);
        assert_eq!(parse_chunks(&[b"event: x\n"]), vec![]);
    }

    fn piece() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            Just(b"data: ".to_vec()),
            Just(b"data:".to_vec()),
            Just(b"event: ".to_vec()),
            Just(b": comment".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r\n".to_vec()),
            Just("é€😀".as_bytes().to_vec()),
            vec(any::<u8>(), 0..8),
        ]
    }

    proptest! {
        #[test]
        fn chunking_never_changes_the_events(
            pieces in vec(piece(), 0..40),
            cuts in vec(any::<usize>(), 0..12),
        ) {
            let body = pieces.concat();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (body.len() + 1)).collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut start = 0;
            for cut in cuts {
                chunks.push(&body[start..cut]);
                start = cut;
            }
            chunks.push(&body[start..]);
            prop_assert_eq!(parse_chunks(&chunks), parse_chunks(&[&body]));
        }
    }
}
