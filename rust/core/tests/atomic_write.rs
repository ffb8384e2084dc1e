//! The container writers (encode_file, decode_file, save_tensors) write through a temporary file
//! of a unique name beside the output: a user's file of any fixed name there is never touched, and
//! concurrent writers of one output never share a temporary file.

use std::fs;
use std::path::{Path, PathBuf};

use weightszip_core::codec::{save_tensors, EncodeOptions};
use weightszip_core::format::LAYOUT_FILE_BYTES;
use weightszip_core::{decode_file, encode_file, DType, TensorMeta};

/// A fresh, empty folder of its own under the system's temporary folder.
fn scratch(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weightszip-core-{test}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn bytes_meta(n: u64) -> TensorMeta {
    TensorMeta { layout: LAYOUT_FILE_BYTES, ..TensorMeta::new(DType::U8, vec![n]) }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_file_named_like_the_old_fixed_temporary_name_is_left_alone() {
    let d = scratch("fixed-name");
    let input = d.join("in.bin");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(&input, &data).unwrap();
    let (out, back) = (d.join("out.wz"), d.join("back.bin"));
    // Files a user may well have, under the names the writers used to truncate and rename away.
    let (mine_out, mine_back) = (d.join(".out.wz.wz-partial"), d.join(".back.bin.wz-partial"));
    fs::write(&mine_out, b"mine, not weightszip's").unwrap();
    fs::write(&mine_back, b"also mine").unwrap();
    let opts = EncodeOptions::default();
    encode_file(&input, &out, &[bytes_meta(data.len() as u64)], &opts, &mut |_, _| {}).unwrap();
    decode_file(&out, Some(&back), 0, &mut |_, _| {}).unwrap();
    assert_eq!(fs::read(&back).unwrap(), data);
    assert_eq!(fs::read(&mine_out).unwrap(), b"mine, not weightszip's");
    assert_eq!(fs::read(&mine_back).unwrap(), b"also mine");
    // (and no temporary file of its own is left behind)
    assert_eq!(names(&d), [".back.bin.wz-partial", ".out.wz.wz-partial", "back.bin", "in.bin", "out.wz"]);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn concurrent_writers_of_one_output_do_not_collide() {
    let d = scratch("concurrent");
    let out = d.join("same.wz");
    let opts = EncodeOptions { threads: 1, ..EncodeOptions::default() };
    let payloads: Vec<Vec<u8>> =
        (0..8u32).map(|k| (0..(1u32 << 20)).map(|i| (i.wrapping_mul(k + 3) >> 5) as u8).collect()).collect();
    std::thread::scope(|s| {
        for p in &payloads {
            let (out, opts) = (&out, &opts);
            s.spawn(move || {
                for _ in 0..4 {
                    save_tensors(out, &[(TensorMeta::new(DType::U8, vec![p.len() as u64]), p)], opts).unwrap();
                }
            });
        }
    });
    // The output is one writer's whole container, and no temporary file is left.
    let back = d.join("back.bin");
    decode_file(&out, Some(&back), 0, &mut |_, _| {}).unwrap();
    assert!(payloads.contains(&fs::read(&back).unwrap()));
    assert_eq!(names(&d), ["back.bin", "same.wz"]);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_long_output_name_still_gets_a_temporary_file() {
    let d = scratch("long-name");
    let input = d.join("in.bin");
    fs::write(&input, b"hello").unwrap();
    // 250 bytes: the output's name fits the file system's 255, the name with a suffix would not
    let out = d.join(format!("{}.wz", "é".repeat(124)));
    encode_file(&input, &out, &[bytes_meta(5)], &EncodeOptions::default(), &mut |_, _| {}).unwrap();
    let back = d.join("back.bin");
    decode_file(&out, Some(&back), 0, &mut |_, _| {}).unwrap();
    assert_eq!(fs::read(&back).unwrap(), b"hello");
    fs::remove_dir_all(&d).unwrap();
}
