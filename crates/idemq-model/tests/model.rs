//! The protocol model checked exhaustively: the real protocol satisfies
//! every property for both store families, and each known-bad variant is
//! caught with a counterexample.

use idemq_model::{
    Flaws, InboxModel, Report, StoreKind, NO_DOUBLE_EFFECT, NO_FENCE_REUSE, NO_LOSS,
    NO_STALE_COMPLETION,
};

fn check(model: InboxModel) -> Report {
    let label = format!("{:?} {:?}", model.store, model.flaws);
    let report = model.check();
    println!("{label}: {report}");
    assert!(
        report.complete,
        "the check must visit every state: {report}"
    );
    report
}

fn find_violation(model: InboxModel) -> Report {
    let label = format!("{:?} {:?}", model.store, model.flaws);
    let report = model.find_violation();
    println!("{label}: {report}");
    report
}

fn assert_sound(report: &Report) {
    assert!(report.violations.is_empty(), "{report}");
    assert!(
        report.all_applied_reachable,
        "the model must be able to apply everything: {report}"
    );
}

#[test]
fn transactional_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::Transactional));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

#[test]
fn lease_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::Lease));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

#[test]
fn record_lease_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::LeaseRecord));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

#[test]
fn record_lease_release_that_forgets_the_fence_is_caught() {
    let report = find_violation(InboxModel::new(StoreKind::LeaseRecord).with_flaws(Flaws {
        release_forgets_fence: true,
        ..Flaws::default()
    }));
    assert!(report.violated(NO_FENCE_REUSE), "{report}");
}

#[test]
fn check_then_insert_is_caught_in_every_store() {
    for store in [
        StoreKind::Transactional,
        StoreKind::Lease,
        StoreKind::LeaseRecord,
    ] {
        let report = find_violation(InboxModel::new(store).with_flaws(Flaws {
            check_then_insert: true,
            ..Flaws::default()
        }));
        assert!(report.violated(NO_DOUBLE_EFFECT), "{store:?}: {report}");
    }
}

#[test]
fn ack_before_commit_is_caught_in_every_store() {
    for store in [
        StoreKind::Transactional,
        StoreKind::Lease,
        StoreKind::LeaseRecord,
    ] {
        let report = find_violation(InboxModel::new(store).with_flaws(Flaws {
            ack_before_commit: true,
            ..Flaws::default()
        }));
        assert!(report.violated(NO_LOSS), "{store:?}: {report}");
    }
}

#[test]
fn completion_without_compare_and_set_is_caught() {
    for store in [StoreKind::Lease, StoreKind::LeaseRecord] {
        let report = find_violation(InboxModel::new(store).with_flaws(Flaws {
            complete_without_cas: true,
            ..Flaws::default()
        }));
        assert!(report.violated(NO_STALE_COMPLETION), "{store:?}: {report}");
    }
}

#[test]
fn downstream_write_without_fencing_is_caught() {
    for store in [StoreKind::Lease, StoreKind::LeaseRecord] {
        let report = find_violation(InboxModel::new(store).with_flaws(Flaws {
            write_without_fencing: true,
            ..Flaws::default()
        }));
        assert!(report.violated(NO_STALE_COMPLETION), "{store:?}: {report}");
    }
}

/// Larger bounds (about a minute in release). Run with `--ignored`.
#[test]
#[ignore = "larger bounds take minutes in debug; run with --release -- --ignored"]
fn every_store_keeps_every_property_with_larger_bounds() {
    let mut tx = InboxModel::new(StoreKind::Transactional);
    tx.messages = 3;
    tx.max_faults = 3;
    tx.max_duplicates = 2;
    assert_sound(&check(tx));
    let mut lease = InboxModel::new(StoreKind::Lease);
    lease.max_faults = 2;
    lease.max_duplicates = 1;
    lease.max_premature_expiries = 2;
    assert_sound(&check(lease.clone()));
    lease.store = StoreKind::LeaseRecord;
    assert_sound(&check(lease));
}
