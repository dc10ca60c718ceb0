//! Image files for `read`: which files are images (by their first bytes, never by the name),
//! their size in pixels (from the header alone, with no image library), and the bounds an image
//! must keep to reach a model.
//!
//! It does not decode, resize or convert pixels: an image goes to the model as the file's own
//! bytes, or not at all, with an error saying how to make it fit.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use skiff_protocol::model::Image;
use skiff_protocol::transcript::EntryBody;

/// The largest image file `read` gives the model. Its base64 form is then at most 3 MiB
/// ([`MAX_CONTEXT_IMAGE_BYTES`]), under the 5 MB Anthropic takes per image, so that a worker's
/// model request — the context within the compaction budget plus its images — fits the
/// gateway's limit for it and one worker frame (`MAX_FRAME_BYTES`, 8 MiB).
pub(crate) const MAX_IMAGE_BYTES: u64 = 2 * 1024 * 1024 + 256 * 1024;

/// The widest or tallest image providers take (Anthropic refuses more than 8000 px a side).
pub(crate) const MAX_IMAGE_SIDE: u32 = 8000;

/// The most image data (base64) one request carries: the newest images of the context up to
/// this, older ones replaced by a line saying so. Keeps a worker's model request within its
/// frame however many images a session reads.
pub const MAX_CONTEXT_IMAGE_BYTES: usize = 3 * 1024 * 1024;

/// An image format a model takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Png,
    Jpeg,
    Gif,
    Webp,
}

impl Format {
    pub(crate) fn media_type(self) -> &'static str {
        match self {
            Format::Png => "image/png",
            Format::Jpeg => "image/jpeg",
            Format::Gif => "image/gif",
            Format::Webp => "image/webp",
        }
    }

    /// "PNG", as a description names it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Format::Png => "PNG",
            Format::Jpeg => "JPEG",
            Format::Gif => "GIF",
            Format::Webp => "WebP",
        }
    }

    fn from_media_type(media_type: &str) -> Option<Format> {
        [Format::Png, Format::Jpeg, Format::Gif, Format::Webp]
            .into_iter()
            .find(|f| f.media_type() == media_type)
    }
}

/// The format the first bytes of a file announce, if it is an image a model takes.
pub(crate) fn sniff(head: &[u8]) -> Option<Format> {
    if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(Format::Png)
    } else if head.starts_with(&[0xff, 0xd8, 0xff]) {
        Some(Format::Jpeg)
    } else if head.starts_with(b"GIF87a") || head.starts_with(b"GIF89a") {
        Some(Format::Gif)
    } else if head.len() >= 12 && head.starts_with(b"RIFF") && &head[8..12] == b"WEBP" {
        Some(Format::Webp)
    } else {
        None
    }
}

/// Width and height in pixels, read from the header of a file of `format`; `None` when the
/// header is cut short or damaged.
pub(crate) fn dimensions(format: Format, bytes: &[u8]) -> Option<(u32, u32)> {
    let be16 = |at: usize| Some(u16::from_be_bytes(bytes.get(at..at + 2)?.try_into().ok()?));
    let le16 = |at: usize| Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?));
    let be32 = |at: usize| Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
    let le24 = |at: usize| {
        let b = bytes.get(at..at + 3)?;
        Some(u32::from(b[0]) | u32::from(b[1]) << 8 | u32::from(b[2]) << 16)
    };
    let found = match format {
        // The IHDR chunk comes first: its length, its type, then width and height.
        Format::Png => (bytes.get(12..16)? == b"IHDR").then_some((be32(16)?, be32(20)?))?,
        Format::Gif => (u32::from(le16(6)?), u32::from(le16(8)?)),
        Format::Webp => match bytes.get(12..16)? {
            // Lossy: a key frame's start code, then 14-bit width and height.
            b"VP8 " => {
                (bytes.get(23..26)? == [0x9d, 0x01, 0x2a]).then_some(())?;
                (u32::from(le16(26)? & 0x3fff), u32::from(le16(28)? & 0x3fff))
            }
            // Lossless: a signature byte, then width - 1 and height - 1 in 14 bits each.
            b"VP8L" => {
                (*bytes.get(20)? == 0x2f).then_some(())?;
                let bits = u32::from_le_bytes(bytes.get(21..25)?.try_into().ok()?);
                ((bits & 0x3fff) + 1, ((bits >> 14) & 0x3fff) + 1)
            }
            // Extended: the canvas, width - 1 and height - 1 in 24 bits each.
            b"VP8X" => (le24(24)? + 1, le24(27)? + 1),
            _ => return None,
        },
        Format::Jpeg => {
            // Segments after the start-of-image marker, up to a start-of-frame one.
            let mut at = 2;
            loop {
                if *bytes.get(at)? != 0xff {
                    return None;
                }
                let marker = *bytes.get(at + 1)?;
                match marker {
                    // Fill bytes before a marker.
                    0xff => at += 1,
                    // Markers with no segment after them.
                    0x01 | 0xd0..=0xd7 => at += 2,
                    0xc0..=0xc3 | 0xc5..=0xc7 | 0xc9..=0xcb | 0xcd..=0xcf => {
                        // Length, precision, then height before width.
                        break (u32::from(be16(at + 7)?), u32::from(be16(at + 5)?));
                    }
                    // End of image or start of scan before any frame header: damaged.
                    0xd9 | 0xda => return None,
                    _ => at += 2 + usize::from(be16(at + 2)?),
                }
            }
        }
    };
    (found.0 > 0 && found.1 > 0).then_some(found)
}

/// What the model reads in place of an image a step had no room for.
pub(crate) const STEP_IMAGE_LEFT_OUT: &str = "(the image is not shown: the images read before it \
     in this step fill the room one step has; read it again on its own)";

/// Keeps a step's images, in call order, up to [`MAX_CONTEXT_IMAGE_BYTES`] of base64 in all; a
/// later one is dropped with a line saying so. A step's results are committed together (on a
/// worker, in one frame, which must stay within `MAX_FRAME_BYTES`), so several large images read
/// at once cannot make the commit too large to send.
pub(crate) fn bound_step(results: &mut [EntryBody]) {
    let mut kept = 0usize;
    for result in results {
        if let EntryBody::ToolResult {
            content, images, ..
        } = result
        {
            keep_within_budget(content, images, &mut kept, STEP_IMAGE_LEFT_OUT);
        }
    }
}

/// Keeps the images of one tool result while the running total `kept` of their base64 bytes
/// stays within [`MAX_CONTEXT_IMAGE_BYTES`]; each one left out adds `note` to the result's
/// text, so the model knows an image was there.
pub(crate) fn keep_within_budget(
    content: &mut String,
    images: &mut Vec<Image>,
    kept: &mut usize,
    note: &str,
) {
    let before = images.len();
    images.retain(|image| {
        let fits = *kept + image.data_base64.len() <= MAX_CONTEXT_IMAGE_BYTES;
        if fits {
            *kept += image.data_base64.len();
        }
        fits
    });
    for _ in images.len()..before {
        content.push('\n');
        content.push_str(note);
    }
}

/// The model's copy of an image file.
pub(crate) fn encode(format: Format, bytes: &[u8]) -> Image {
    Image {
        media_type: format.media_type().to_owned(),
        data_base64: STANDARD.encode(bytes),
    }
}

/// How an image reads in a transcript: `image 1280×720 png` (without the size when its header
/// cannot be read, as in an image some other program wrote into a transcript).
pub fn label(image: &Image) -> String {
    let kind = image
        .media_type
        .strip_prefix("image/")
        .unwrap_or(&image.media_type);
    // A header is within the first few KiB, but a JPEG's metadata can come first: decode up to
    // 256 KiB (a whole multiple of four characters, so it decodes on its own).
    let end = image.data_base64.len().min(256 * 1024 / 3 * 4);
    let prefix = image.data_base64.get(..end).unwrap_or_default();
    let size = Format::from_media_type(&image.media_type)
        .zip(STANDARD.decode(prefix).ok())
        .and_then(|(format, bytes)| dimensions(format, &bytes));
    match size {
        Some((w, h)) => format!("image {w}×{h} {kind}"),
        None => format!("image {kind}"),
    }
}

/// The bound as the error names it ("2.25 MiB").
pub(crate) fn limit() -> String {
    format!("{} MiB", MAX_IMAGE_BYTES as f64 / (1024.0 * 1024.0))
}

/// "812 bytes", "84 KiB", "3.2 MiB".
pub(crate) fn size(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else if bytes < 1024 * 1024 {
        format!("{} KiB", (bytes + 512) / 1024)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png_header(w: u32, h: u32) -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend_from_slice(&w.to_be_bytes());
        b.extend_from_slice(&h.to_be_bytes());
        b
    }

    #[test]
    fn formats_are_known_by_their_first_bytes() {
        assert_eq!(sniff(&png_header(1, 1)), Some(Format::Png));
        assert_eq!(sniff(b"\xff\xd8\xff\xe0\0\x10JFIF"), Some(Format::Jpeg));
        assert_eq!(sniff(b"GIF89a\x01\0\x01\0"), Some(Format::Gif));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), Some(Format::Webp));
        assert_eq!(sniff(b"RIFF\0\0\0\0WAVEfmt "), None);
        assert_eq!(sniff(b"fn main() {}\n"), None);
    }

    #[test]
    fn sizes_come_from_each_formats_header() {
        assert_eq!(
            dimensions(Format::Png, &png_header(1280, 720)),
            Some((1280, 720))
        );
        assert_eq!(
            dimensions(Format::Gif, b"GIF89a\x00\x05\xd0\x02"),
            Some((1280, 720))
        );
        // A JPEG with an APP0 segment before its baseline frame header.
        let mut jpeg = b"\xff\xd8\xff\xe0\x00\x10JFIF\0\x01\x01\0\0\x01\0\x01\0\0".to_vec();
        jpeg.extend_from_slice(b"\xff\xc0\x00\x11\x08\x02\xd0\x05\x00\x03");
        assert_eq!(dimensions(Format::Jpeg, &jpeg), Some((1280, 720)));
        let mut lossy = b"RIFF\0\0\0\0WEBPVP8 \0\0\0\0\x10\x02\x00\x9d\x01\x2a".to_vec();
        lossy.extend_from_slice(&1280u16.to_le_bytes());
        lossy.extend_from_slice(&720u16.to_le_bytes());
        assert_eq!(dimensions(Format::Webp, &lossy), Some((1280, 720)));
        let mut lossless = b"RIFF\0\0\0\0WEBPVP8L\0\0\0\0\x2f".to_vec();
        lossless.extend_from_slice(&(1279u32 | 719 << 14).to_le_bytes());
        assert_eq!(dimensions(Format::Webp, &lossless), Some((1280, 720)));
        let mut extended = b"RIFF\0\0\0\0WEBPVP8X\0\0\0\0\0\0\0\0".to_vec();
        extended.extend_from_slice(&[0xff, 0x04, 0x00, 0xcf, 0x02, 0x00]);
        assert_eq!(dimensions(Format::Webp, &extended), Some((1280, 720)));
    }

    #[test]
    fn a_cut_or_damaged_header_has_no_size() {
        assert_eq!(dimensions(Format::Png, &png_header(1, 1)[..20]), None);
        assert_eq!(dimensions(Format::Png, &png_header(0, 5)), None);
        assert_eq!(dimensions(Format::Jpeg, b"\xff\xd8\xff\xda"), None);
        assert_eq!(dimensions(Format::Jpeg, b"\xff\xd8\x00"), None);
        assert_eq!(dimensions(Format::Gif, b"GIF89a\x01"), None);
    }

    #[test]
    fn a_label_names_the_size_and_kind_never_the_data() {
        let image = encode(Format::Png, &png_header(1280, 720));
        assert_eq!(label(&image), "image 1280×720 png");
        let odd = Image {
            media_type: "image/png".into(),
            data_base64: "not base64!".into(),
        };
        assert_eq!(label(&odd), "image png");
    }

    #[test]
    fn sizes_read_in_binary_units() {
        assert_eq!(size(812), "812 bytes");
        assert_eq!(size(84 * 1024 + 100), "84 KiB");
        assert_eq!(size(MAX_IMAGE_BYTES + 1), "2.3 MiB");
        assert_eq!(limit(), "2.25 MiB");
    }

    #[test]
    fn a_step_keeps_its_images_in_call_order_up_to_the_bound() {
        let result = |n: usize| EntryBody::ToolResult {
            call_id: format!("c{n}"),
            name: "read".into(),
            content: format!("image: {n}.png"),
            is_error: false,
            images: vec![Image {
                media_type: "image/png".into(),
                data_base64: "A".repeat(MAX_CONTEXT_IMAGE_BYTES / 2),
            }],
        };
        let mut results = vec![result(1), result(2), result(3)];
        bound_step(&mut results);
        let shown: Vec<(String, usize)> = results
            .iter()
            .map(|r| match r {
                EntryBody::ToolResult {
                    content, images, ..
                } => (content.clone(), images.len()),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(
            shown,
            [
                ("image: 1.png".to_owned(), 1),
                ("image: 2.png".to_owned(), 1),
                (format!("image: 3.png\n{STEP_IMAGE_LEFT_OUT}"), 0),
            ]
        );
    }
}
