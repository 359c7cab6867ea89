//! The wire format against tests/vectors.json, written from PROTOCOL.md by an independent
//! generator (tests/gen_vectors.py): what a second implementation must agree with.

use coherent_rpc::frame::{
    batch_len, read_varint, write_varint, BatchItems, Compression, FrameError, Header, Kind,
};
use coherent_rpc::handshake::Hello;
use coherent_rpc::{method_id, ErrorCode, Format};
use serde_json::Value;

fn vectors() -> Value {
    serde_json::from_str(include_str!("../vectors.json")).expect("vectors.json parses")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn kind(name: &str) -> Kind {
    match name {
        "Hello" => Kind::Hello,
        "HelloAck" => Kind::HelloAck,
        "Call" => Kind::Call,
        "OneWay" => Kind::OneWay,
        "Ok" => Kind::Ok,
        "Error" => Kind::Error,
        "Cancel" => Kind::Cancel,
        "StreamItem" => Kind::StreamItem,
        "StreamEnd" => Kind::StreamEnd,
        "StreamAck" => Kind::StreamAck,
        "Ping" => Kind::Ping,
        "Pong" => Kind::Pong,
        "Close" => Kind::Close,
        "StreamBatch" => Kind::StreamBatch,
        other => panic!("unknown kind {other}"),
    }
}

#[test]
fn method_ids_match_the_vectors() {
    for v in vectors()["method_ids"].as_array().unwrap() {
        assert_eq!(
            u64::from(method_id(v["name"].as_str().unwrap())),
            v["id"].as_u64().unwrap(),
            "{v}"
        );
    }
}

#[test]
fn varints_match_the_vectors_both_ways() {
    for v in vectors()["varints"].as_array().unwrap() {
        let value: u64 = v["value"].as_str().unwrap().parse().unwrap();
        let bytes = hex(v["bytes"].as_str().unwrap());
        let mut buf = [0u8; 10];
        let n = write_varint(value, &mut buf);
        assert_eq!(&buf[..n], &bytes[..], "{v}");
        assert_eq!(read_varint(&bytes), Ok(Some((value, bytes.len()))), "{v}");
    }
}

#[test]
fn frames_encode_and_decode_to_the_vectors() {
    for v in vectors()["frames"].as_array().unwrap() {
        let bytes = hex(v["bytes"].as_str().unwrap());
        let payload = hex(v["payload"].as_str().unwrap());
        let header = Header {
            kind: kind(v["kind"].as_str().unwrap()),
            compression: match v["compression"].as_str().unwrap() {
                "None" => Compression::None,
                "Lz4" => Compression::Lz4,
                "Zstd" => Compression::Zstd,
                c => panic!("{c}"),
            },
            upload: v["upload"].as_bool().unwrap_or(false),
            call_id: v["call_id"].as_str().unwrap().parse().unwrap(),
            method_id: v["method_id"].as_u64().unwrap() as u32,
            len: payload.len() as u32,
        };
        let mut head = [0u8; 19];
        let n = header.encode(&mut head);
        assert_eq!(&head[..n], &bytes[..n], "{}", v["name"]);
        assert_eq!(&bytes[n..], &payload[..], "{}", v["name"]);
        assert_eq!(
            Header::decode(&bytes, u32::MAX),
            Ok(Some((header, n))),
            "{}",
            v["name"]
        );
    }
}

#[test]
fn invalid_frames_are_refused_with_the_vectors_error() {
    for v in vectors()["invalid_frames"].as_array().unwrap() {
        let bytes = hex(v["bytes"].as_str().unwrap());
        let max = v["max_len"].as_u64().map_or(u32::MAX, |m| m as u32);
        let err = Header::decode(&bytes, max).expect_err(v["name"].as_str().unwrap());
        let name = match err {
            FrameError::UnknownKind(_) => "UnknownKind",
            FrameError::BadFlags(_) => "BadFlags",
            FrameError::BadVarint => "BadVarint",
            FrameError::TooLarge { .. } => "TooLarge",
            _ => "other",
        };
        assert_eq!(name, v["error"].as_str().unwrap(), "{}", v["name"]);
    }
}

#[test]
fn stream_batches_split_as_the_vectors_say() {
    for v in vectors()["stream_batches"].as_array().unwrap() {
        let payload = hex(v["payload"].as_str().unwrap());
        let name = v["name"].as_str().unwrap();
        match v["items"].as_array() {
            Some(items) => {
                let want: Vec<Vec<u8>> = items.iter().map(|i| hex(i.as_str().unwrap())).collect();
                let got: Vec<Vec<u8>> = BatchItems::new(&payload)
                    .map(|i| i.expect(name).to_vec())
                    .collect();
                assert_eq!(got, want, "{name}");
                assert_eq!(batch_len(&payload), Ok(want.len() as u32), "{name}");
            }
            None => {
                assert_eq!(v["error"].as_str(), Some("BadBatch"), "{name}");
                assert_eq!(batch_len(&payload), Err(FrameError::BadBatch), "{name}");
            }
        }
    }
}

#[test]
fn incomplete_frames_ask_for_more_bytes() {
    for v in vectors()["incomplete_frames"].as_array().unwrap() {
        let bytes = hex(v["bytes"].as_str().unwrap());
        assert_eq!(Header::decode(&bytes, u32::MAX), Ok(None), "{}", v["name"]);
    }
}

#[test]
fn handshakes_encode_and_decode_to_the_vectors() {
    for v in vectors()["hellos"].as_array().unwrap() {
        let bytes = hex(v["bytes"].as_str().unwrap());
        let hello = Hello::decode(&bytes).unwrap();
        let format = match v["format"].as_str().unwrap() {
            "Postcard" => Format::Postcard,
            _ => Format::MessagePack,
        };
        assert_eq!(hello.format, format);
        assert_eq!(
            u64::from(hello.max_message_size),
            v["max_message_size"].as_u64().unwrap()
        );
        assert_eq!(
            u64::from(hello.max_inbound_calls),
            v["max_inbound_calls"].as_u64().unwrap()
        );
        assert_eq!(
            u64::from(hello.stream_window),
            v["stream_window"].as_u64().unwrap()
        );
        assert_eq!(hello.token, v["token"].as_str().unwrap());
        assert_eq!(hello.encode(), bytes, "{}", v["name"]);
    }
}

#[test]
fn invalid_handshakes_are_refused_with_the_vectors_code() {
    for v in vectors()["invalid_hellos"].as_array().unwrap() {
        let bytes = hex(v["bytes"].as_str().unwrap());
        let err = Hello::decode(&bytes).expect_err(v["name"].as_str().unwrap());
        assert_eq!(
            u64::from(err.code().as_u16()),
            v["code"].as_u64().unwrap(),
            "{}",
            v["name"]
        );
    }
}

#[test]
fn error_codes_match_the_vectors() {
    for v in vectors()["errors"].as_array().unwrap() {
        let code = ErrorCode::from_u16(v["code"].as_u64().unwrap() as u16);
        assert_eq!(format!("{code:?}"), v["name"].as_str().unwrap());
    }
}

/// MessagePack as section 4 says the Rust side writes it (structs as maps, a Uuid as its
/// string): each vector's bytes are what `Format::MessagePack` encodes for its Rust value, and
/// decode back to it.
#[test]
fn messagepack_payloads_match_the_vectors() {
    use coherent_rpc::Blob;
    use serde::{de::DeserializeOwned, Deserialize, Serialize};
    use std::fmt::Debug;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Item {
        id: uuid::Uuid,
        title: String,
        done: bool,
        tag: Option<String>,
    }
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Status {
        Open,
    }
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Shape {
        Square(u32),
    }
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Failure {
        UnknownMethod(u32),
        BadArguments(String),
    }
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Held(u64, u32, Blob, u64);

    fn check<T: Serialize + DeserializeOwned + PartialEq + Debug>(
        name: &str,
        bytes: &[u8],
        value: T,
    ) {
        let encoded = Format::MessagePack.encode(&value).unwrap();
        assert_eq!(&encoded[..], bytes, "{name}: encoding");
        let decoded: T = Format::MessagePack.decode(bytes).unwrap();
        assert_eq!(decoded, value, "{name}: decoding");
    }

    let sum_args = Blob::from(vec![0x92, 0x02, 0x28]);
    let sum = method_id("Calc.sum");
    let mut seen = 0;
    for v in vectors()["messagepack"].as_array().unwrap() {
        let name = v["name"].as_str().unwrap();
        let b = hex(v["bytes"].as_str().unwrap());
        seen += 1;
        match name {
            "Calc.sum's arguments" => check(name, &b, (2i32, 40i32)),
            "negative and wide integers" => {
                check(name, &b, (-1i8, -300i16, -(1i64 << 40), u32::MAX))
            }
            "a u64 past 2^53" => check(name, &b, ((1u64 << 63) + 5,)),
            "a string and bytes" => {
                check(name, &b, ("héllo".to_owned(), Blob::from(vec![0, 1, 255])))
            }
            "an Option" => check(name, &b, (None::<u32>, Some(7u32))),
            "a struct is a map by field name" => check(
                name,
                &b,
                Item {
                    id: "0190f3c4-5a6b-7c8d-9e0f-a1b2c3d4e5f6".parse().unwrap(),
                    title: "Write the spec".into(),
                    done: false,
                    tag: None,
                },
            ),
            "a unit variant is its name" => check(name, &b, Status::Open),
            "a variant with data is a one-entry map" => check(name, &b, Shape::Square(3)),
            "ReplicaHost.fetch's arguments" => check(name, &b, (sum, sum_args.clone(), 7u64)),
            "ReplicaHost.fetch's answer: Ok" => {
                check(name, &b, Ok::<Blob, Failure>(Blob::from(vec![42])))
            }
            "ReplicaHost.fetch's answer: a Failure" => check(
                name,
                &b,
                Err::<Blob, Failure>(Failure::BadArguments("expected 2 arguments".into())),
            ),
            "ReplicaHost.revalidate's arguments" => check(
                name,
                &b,
                (vec![Held(3, sum, sum_args.clone(), 0xCBF2_9CE4_8422_2325)],),
            ),
            "ReplicaHost.revalidate's answer" => check(name, &b, vec![3u64]),
            "ReplicaSink.invalidated's arguments" => check(name, &b, (vec![1u64, 2, 300],)),
            "ReplicaSink.invalidated's answer" => check(name, &b, ()),
            other => panic!("no Rust value for the vector {other:?}"),
        }
    }
    assert_eq!(seen, 15);
}
