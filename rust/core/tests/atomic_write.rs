//! The container writers (encode_file, decode_file, save_tensors) write through a temporary file
//! of a unique name beside the output: a user's file of any fixed name there is never touched, and
//! concurrent writers of one output never share a temporary file.

use std::fs;
use std::path::{Path, PathBuf};

use weightszip_core::codec::{save_tensors, EncodeOptions, OnExisting};
use weightszip_core::format::{Index, LAYOUT_FILE_BYTES};
use weightszip_core::{decode_file, encode_file, DType, Error, Output, TensorMeta};

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

/// `encode_file` of `input` as one segment of `n` plain bytes, default options, no progress.
fn encode_bytes(input: &Path, out: Output<'_>, n: u64) -> weightszip_core::Result<Index> {
    encode_file(input, out, &[bytes_meta(n)], &EncodeOptions::default(), &mut |_, _| Ok(()))
}

/// `decode_file` of `input` with no prefix and no progress (`out` None: verify only).
fn decode(input: &Path, out: Option<Output<'_>>) -> weightszip_core::Result<Index> {
    decode_file(input, out, &[], 0, &mut |_, _| Ok(()))
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
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
    encode_bytes(&input, Output::new(&out, OnExisting::Replace), data.len() as u64).unwrap();
    decode(&out, Some(Output::new(&back, OnExisting::Replace))).unwrap();
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
                    save_tensors(
                        out,
                        &[(TensorMeta::new(DType::U8, vec![p.len() as u64]), p)],
                        opts,
                        OnExisting::Replace,
                    )
                    .unwrap();
                }
            });
        }
    });
    // The output is one writer's whole container, and no temporary file is left.
    let back = d.join("back.bin");
    decode(&out, Some(Output::new(&back, OnExisting::Replace))).unwrap();
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
    encode_bytes(&input, Output::new(&out, OnExisting::Replace), 5).unwrap();
    let back = d.join("back.bin");
    decode(&out, Some(Output::new(&back, OnExisting::Replace))).unwrap();
    assert_eq!(fs::read(&back).unwrap(), b"hello");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn refuse_never_replaces_a_file_created_while_the_output_was_written() {
    let d = scratch("refuse");
    let input = d.join("in.bin");
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13 % 241) as u8).collect();
    fs::write(&input, &data).unwrap();
    let out = d.join("out.wz");
    let opts = EncodeOptions { chunk_bytes: 1 << 16, threads: 1, ..EncodeOptions::default() };
    let segs = [bytes_meta(data.len() as u64)];
    // Another program creates the output after any check a caller made, while it is being written.
    let mut created = false;
    let mut race = |_, _| {
        if !created {
            fs::write(&out, b"theirs").unwrap();
            created = true;
        }
        Ok(())
    };
    let err = encode_file(&input, Output::new(&out, OnExisting::Refuse), &segs, &opts, &mut race).unwrap_err();
    assert!(matches!(&err, Error::OutputExists(p) if p.ends_with("out.wz")), "{err}");
    assert_eq!(err.to_string(), format!("{}: already exists; not overwritten", out.display()));
    assert_eq!(fs::read(&out).unwrap(), b"theirs");
    assert_eq!(names(&d), ["in.bin", "out.wz"], "no temporary file is left");
    // a dangling symbolic link is a taken name too
    #[cfg(unix)]
    {
        let link = d.join("link.wz");
        std::os::unix::fs::symlink(d.join("nowhere"), &link).unwrap();
        let err =
            encode_file(&input, Output::new(&link, OnExisting::Refuse), &segs, &opts, &mut |_, _| Ok(())).unwrap_err();
        assert!(matches!(err, Error::OutputExists(_)));
        assert!(!d.join("nowhere").exists());
        fs::remove_file(&link).unwrap();
    }
    // a free name is published, by every writer
    fs::remove_file(&out).unwrap();
    encode_file(&input, Output::new(&out, OnExisting::Refuse), &segs, &opts, &mut |_, _| Ok(())).unwrap();
    let back = d.join("back.bin");
    decode(&out, Some(Output::new(&back, OnExisting::Refuse))).unwrap();
    assert_eq!(fs::read(&back).unwrap(), data);
    let err = decode(&out, Some(Output::new(&back, OnExisting::Refuse))).unwrap_err();
    assert!(matches!(err, Error::OutputExists(_)));
    let t = d.join("t.wz");
    save_tensors(&t, &[(TensorMeta::new(DType::U8, vec![3]), b"abc")], &opts, OnExisting::Refuse).unwrap();
    let err =
        save_tensors(&t, &[(TensorMeta::new(DType::U8, vec![3]), b"xyz")], &opts, OnExisting::Refuse).unwrap_err();
    assert!(matches!(err, Error::OutputExists(_)));
    // Replace replaces
    encode_file(&input, Output::new(&back, OnExisting::Replace), &segs, &opts, &mut |_, _| Ok(())).unwrap();
    assert_eq!(fs::read(&back).unwrap(), fs::read(&out).unwrap());
    assert_eq!(names(&d), ["back.bin", "in.bin", "out.wz", "t.wz"]);
    fs::remove_dir_all(&d).unwrap();
}

#[cfg(unix)]
#[test]
fn replacing_a_file_keeps_its_permission_mode() {
    use std::os::unix::fs::PermissionsExt;
    let d = scratch("mode");
    let input = d.join("in.bin");
    fs::write(&input, b"hello").unwrap();
    let out = d.join("out.wz");
    fs::write(&out, b"old").unwrap();
    fs::set_permissions(&out, fs::Permissions::from_mode(0o640)).unwrap();
    encode_bytes(&input, Output::new(&out, OnExisting::Replace), 5).unwrap();
    assert_eq!(fs::metadata(&out).unwrap().permissions().mode() & 0o7777, 0o640);
    let back = d.join("back.bin");
    fs::write(&back, b"old").unwrap();
    fs::set_permissions(&back, fs::Permissions::from_mode(0o604)).unwrap();
    decode(&out, Some(Output::new(&back, OnExisting::Replace))).unwrap();
    assert_eq!(fs::read(&back).unwrap(), b"hello");
    assert_eq!(fs::metadata(&back).unwrap().permissions().mode() & 0o7777, 0o604);
    fs::remove_dir_all(&d).unwrap();
}

/// The PID of a process that has exited (and been waited for).
#[cfg(target_os = "linux")]
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
    pid
}

#[cfg(target_os = "linux")]
#[test]
fn temporary_files_of_killed_writers_of_the_output_are_removed() {
    let d = scratch("stale");
    let input = d.join("in.bin");
    fs::write(&input, b"hello").unwrap();
    let (dead, me) = (dead_pid(), std::process::id());
    let stale = [format!(".out.wz.{dead}.0.0123abcd.wz-partial"), format!(".out.wz.{dead}.17.ffffffff.wz-partial")];
    let kept = [
        format!(".out.wz.{me}.3.0123abcd.wz-partial"), // a live writer's (this process)
        ".out.wz.1.3.0123abcd.wz-partial".to_string(), // a live writer's (PID 1 always runs)
        format!(".out.wz.1.{dead}.0.0123abcd.wz-partial"), // output out.wz.1's
        format!(".out.wz.{dead}.0123abcd.wz-partial"), // not the temporary shape
        format!(".out.wz.{dead}.0.0123ABCD.wz-partial"),
        format!("out.wz.{dead}.0.0123abcd.wz-partial"),
        format!(".other.wz.{dead}.0.0123abcd.wz-partial"), // another output's
    ];
    for n in stale.iter().chain(&kept) {
        fs::write(d.join(n), b"partial").unwrap();
    }
    let out = d.join("out.wz");
    encode_bytes(&input, Output::new(&out, OnExisting::Refuse), 5).unwrap();
    let mut want: Vec<String> = kept.to_vec();
    want.extend(["in.bin".to_string(), "out.wz".to_string()]);
    want.sort();
    assert_eq!(names(&d), want);
    // a folder of that name is left too
    fs::create_dir(d.join(&stale[0])).unwrap();
    save_tensors(&out, &[(TensorMeta::new(DType::U8, vec![1]), b"x")], &EncodeOptions::default(), OnExisting::Replace)
        .unwrap();
    assert!(d.join(&stale[0]).is_dir());
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_error_from_progress_stops_the_writer_and_leaves_nothing() {
    let d = scratch("interrupt");
    let input = d.join("in.bin");
    let data: Vec<u8> = (0..400_000u32).map(|i| (i * 11 % 239) as u8).collect();
    fs::write(&input, &data).unwrap();
    let opts = EncodeOptions { chunk_bytes: 1 << 14, threads: 1, ..EncodeOptions::default() };
    let segs = [bytes_meta(data.len() as u64)];
    let out = d.join("out.wz");
    encode_file(&input, Output::new(&out, OnExisting::Refuse), &segs, &opts, &mut |_, _| Ok(())).unwrap();
    let interrupt_at_second_call = || {
        let mut calls = 0;
        move |_, _| {
            calls += 1;
            if calls == 2 {
                return Err(Error::Interrupted("stop".into()));
            }
            Ok(())
        }
    };
    for on_existing in [OnExisting::Replace, OnExisting::Refuse] {
        let err = encode_file(
            &input,
            Output::new(&d.join("new.wz"), on_existing),
            &segs,
            &opts,
            &mut interrupt_at_second_call(),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Interrupted(_)), "{err}");
        let err = decode_file(
            &out,
            Some(Output::new(&d.join("new.bin"), on_existing)),
            &[],
            1,
            &mut interrupt_at_second_call(),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Interrupted(_)), "{err}");
        let err = decode_file(&out, None, &[], 1, &mut interrupt_at_second_call()).unwrap_err();
        assert!(matches!(err, Error::Interrupted(_)), "{err}");
        assert_eq!(names(&d), ["in.bin", "out.wz"], "no output and no temporary file");
    }
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn decode_file_writes_the_prefix_then_the_entries() {
    let d = scratch("prefix");
    let a = (TensorMeta::new(DType::U8, vec![3]), &b"abc"[..]);
    let b = (TensorMeta::new(DType::U8, vec![0]), &b""[..]);
    let c = (TensorMeta::new(DType::U8, vec![70_000]), &[9u8; 70_000][..]);
    let t = d.join("t.wz");
    let opts = EncodeOptions { chunk_bytes: 1 << 12, ..EncodeOptions::default() };
    save_tensors(&t, &[a, b, c], &opts, OnExisting::Refuse).unwrap();
    let out = d.join("t.bin");
    let mut seen = Vec::new();
    decode_file(&t, Some(Output::new(&out, OnExisting::Refuse)), b"HEAD", 1, &mut |done, total| {
        seen.push((done, total));
        Ok(())
    })
    .unwrap();
    let mut want = b"HEADabc".to_vec();
    want.extend([9u8; 70_000]);
    assert_eq!(fs::read(&out).unwrap(), want);
    assert_eq!(seen.first(), Some(&(0, 70_003)));
    assert_eq!(seen.last(), Some(&(70_003, 70_003)));
    assert!(seen.len() > 2 && seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
    fs::remove_dir_all(&d).unwrap();
}

#[cfg(unix)]
#[test]
fn a_new_output_gets_the_given_mode_and_a_replaced_one_keeps_its_own() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let d = scratch("given-mode");
    let input = d.join("in.bin");
    fs::write(&input, b"hello").unwrap();
    let (out, back) = (d.join("out.wz"), d.join("back.bin"));
    let segs = [bytes_meta(5)];
    let opts = EncodeOptions::default();
    for on_existing in [OnExisting::Refuse, OnExisting::Replace] {
        let _ = fs::remove_file(&out);
        let _ = fs::remove_file(&back);
        let o = Output { mode: Some(0o100600), ..Output::new(&out, on_existing) };
        encode_file(&input, o, &segs, &opts, &mut |_, _| Ok(())).unwrap();
        assert_eq!(mode(&out), 0o600);
        let o = Output { mode: Some(0o4751), ..Output::new(&back, on_existing) };
        decode(&out, Some(o)).unwrap();
        assert_eq!((mode(&back), fs::read(&back).unwrap()), (0o751, b"hello".to_vec()), "no setuid bit");
    }
    fs::set_permissions(&back, fs::Permissions::from_mode(0o640)).unwrap();
    let o = Output { mode: Some(0o600), ..Output::new(&back, OnExisting::Replace) };
    decode(&out, Some(o)).unwrap();
    assert_eq!(mode(&back), 0o640, "a replaced file keeps its mode");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn io_errors_name_the_file() {
    let d = scratch("io-names");
    let input = d.join("in.bin");
    fs::write(&input, b"hello").unwrap();
    let missing = d.join("missing.bin");
    let opts = EncodeOptions::default();
    let err = encode_file(&missing, Output::new(&d.join("o.wz"), OnExisting::Refuse), &[], &opts, &mut |_, _| Ok(()))
        .unwrap_err();
    assert!(matches!(&err, Error::Io(e) if e.kind() == std::io::ErrorKind::NotFound), "{err}");
    assert!(err.to_string().contains(&missing.display().to_string()), "{err}");
    let err = decode(&missing, None).unwrap_err();
    assert!(err.to_string().contains(&missing.display().to_string()), "{err}");
    let nodir = d.join("nodir").join("o.wz");
    let err = encode_file(&input, Output::new(&nodir, OnExisting::Refuse), &[bytes_meta(5)], &opts, &mut |_, _| Ok(()))
        .unwrap_err();
    assert!(err.to_string().contains(&nodir.display().to_string()), "{err}");
    fs::create_dir(d.join("dir")).unwrap();
    let err =
        encode_file(&input, Output::new(&d.join("dir"), OnExisting::Replace), &[bytes_meta(5)], &opts, &mut |_, _| {
            Ok(())
        })
        .unwrap_err();
    assert!(err.to_string().contains(&d.join("dir").display().to_string()), "{err}");
    assert_eq!(names(&d), ["dir", "in.bin"]);
    fs::remove_dir_all(&d).unwrap();
}
