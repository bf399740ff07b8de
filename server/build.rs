// `sqlx::migrate!` embeds the migrations when this crate compiles: a new or edited file under
// migrations/ must compile it again.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
